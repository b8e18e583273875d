"""Which `tokenizer.ggml.pre` name a BPE tokenizer gets: llama.cpp picks its split regexes by that name.

llama.cpp (src/llama-vocab.cpp) has no regex in the file: the name selects a hard-coded list of split
regexes and a few flags. A wrong name tokenizes differently from the model, silently, so a name is
written only when it is known to be right. Two ways to know, tried in order:

1. The hash convert_hf_to_gguf.py uses (`get_vocab_base_pre`): sha256 of the text of the token-id list
   the tokenizer gives for llama.cpp's probe text. It identifies a published tokenizer (vocabulary
   included) exactly; `KNOWN_HASHES` holds the ones for the families quantship exports. It is also the
   only way to tell names that split alike apart (`deepseek-r1-qwen` from `qwen2`).
2. The splits themselves: the model's own pre-tokenizer (tokenizer.json, run by the `tokenizers`
   library) on the probe text against each family's regexes as llama.cpp applies them. This does
   not depend on the vocabulary, so a fine-tuned or re-trained vocabulary with a family's
   pre-tokenizer is named too (the hash of 1. then changes).

Neither matches: an error naming the pre-tokenizer and the hash; `--pre-tokenizer NAME` overrides
with any name llama.cpp's loader accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from quantship.errors import QuantshipError

# llama.cpp's probe text (convert_hf_to_gguf_update.py), byte for byte: the hashes depend on it.
PROBE = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
         "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
         "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
         "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
# Splits are compared on more than the probe: kana and hangul (DeepSeek-V3's and -Coder's CJK ranges
# differ there), code, and a trailing space.
_SPLIT_TEXT = PROBE + "\nこんにちは、カタカナ。안녕하세요 def f(x):\n\treturn x**2  # ok\r\n1,234,567.89 "

# convert_hf_to_gguf.py's hashes for the tokenizers of the model families quantship exports.
KNOWN_HASHES = {
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",  # DeepSeek-V3 / R1
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # R1-Distill-Qwen
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # deepseek-coder-6.7b
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # deepseek-llm-7b
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama-3, R1-Distill-Llama
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / Qwen2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
}

# The split regexes llama.cpp applies for each name (llm_tokenizer_bpe), in order; each one splits the
# pieces the previous ones left, keeping matches and the text between them as pieces.
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FAMILY_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",),
    "llama-bpe": (_LLAMA3,),
    "qwen2": (_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}"),),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥\u0800-一가-\ud7ff]+", r"\p{N}"),
}

# Every BPE pre-tokenizer name llama.cpp's loader accepts (llama_vocab::impl::load); any other name
# makes it fall back to its 'default' regexes with a warning, so an override outside these is refused.
LLAMA_CPP_NAMES = frozenset("""
default llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 deepseek-llm deepseek-coder
deepseek-v3 falcon mpt starcoder gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum
jina-v1-en jina-v2-code roberta-bpe refact command-r qwen2 deepseek-r1-qwen kormo stablelm2 olmo dbrx
smaug-bpe poro-chat glm4 chatglm-bpe viking jais tekken smollm codeshell bloom gpt3-finnish exaone exaone4
chameleon minerva-7b megrez gpt-4o llama4 superbpe trillion granite-docling bailingmoe bailingmoe2 llada-moe
seed-coder hunyuan hunyuan-dense kimi-k2 grok-2 afmoe minimax-m2
""".split())


@dataclass(frozen=True)
class PreTokenizer:
    name: str
    how: str  # "hash", "splits" or "override"
    chkhsh: str


def probe_hash(tokenizer) -> str:
    """convert_hf_to_gguf's chkhsh: sha256 of str(ids) for the probe, special tokens added as the
    tokenizer's post-processor adds them (as `AutoTokenizer.encode` does)."""
    return sha256(str(tokenizer.encode(PROBE).ids).encode()).hexdigest()


def family_pre_tokenizer(name: str):
    """llama.cpp's splits for `name` as a `tokenizers` pre-tokenizer (then byte-level, like the models)."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in FAMILY_SPLITS[name]]
    return pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _pieces(pre, text: str) -> list[str]:
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def identify(path: Path, override: str | None = None) -> PreTokenizer:
    """tokenizer.json → the llama.cpp name of its pre-tokenizer, or a one-line error."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises plain Exceptions with the parse error
        raise QuantshipError(f"cannot load the tokenizer ({exc})", path) from None
    chkhsh = probe_hash(tokenizer)
    if override is not None:
        if override not in LLAMA_CPP_NAMES:
            raise QuantshipError(f"--pre-tokenizer {override!r} is not a name llama.cpp knows (e.g. deepseek-v3, "
                                 "deepseek-coder, deepseek-llm, llama-bpe, qwen2, gpt-2)")
        return PreTokenizer(override, "override", chkhsh)
    if chkhsh in KNOWN_HASHES:
        return PreTokenizer(KNOWN_HASHES[chkhsh], "hash", chkhsh)
    if tokenizer.pre_tokenizer is not None:
        ours = _pieces(tokenizer.pre_tokenizer, _SPLIT_TEXT)
        for name in FAMILY_SPLITS:
            if ours == _pieces(family_pre_tokenizer(name), _SPLIT_TEXT):
                return PreTokenizer(name, "splits", chkhsh)
    raise QuantshipError(f"pre-tokenizer {describe(path)} splits text unlike any llama.cpp pre-tokenizer quantship "
                         f"knows ({', '.join(FAMILY_SPLITS)}; probe hash {chkhsh[:16]}); pass --pre-tokenizer NAME "
                         "if you know llama.cpp's name for it", path)


def describe(path: Path) -> str:
    """A short description of tokenizer.json's pre-tokenizer for error messages: types and regexes."""
    try:
        pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return "(unreadable)"

    def one(p: dict) -> str:
        if p.get("type") == "Sequence":
            return "[" + ", ".join(one(q) for q in p.get("pretokenizers", [])) + "]"
        pattern = p.get("pattern") or {}
        regex = pattern.get("Regex") or pattern.get("String")
        if regex is not None:
            short = regex if len(regex) <= 40 else regex[:40] + "..."
            return f"{p.get('type')}({short!r})"
        return str(p.get("type"))

    return one(pre) if pre else "(none)"
