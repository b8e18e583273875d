"""The command line as a user meets it."""

import json
import subprocess
import sys

import pytest

from quantship.cli import EXAMPLES, build_parser, main
from quantship.models.bundled import TINY_DIR


def run(*args):
    return subprocess.run([sys.executable, "-m", "quantship.cli", *args], capture_output=True, text=True)


def test_help_lists_every_command_and_each_has_examples():
    out = run("--help").stdout
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in commands:
        assert name in out
        sub = run(name, "--help")
        assert sub.returncode == 0 and "examples:" in sub.stdout
    assert set(commands) == set(EXAMPLES)


def test_info_json_for_tiny(capsys):
    assert main(["info", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(TINY_DIR.resolve())
    assert info["architecture"] == "DeepseekV3ForCausalLM"
    assert info["moe"]["routed_experts"] == 8 and info["mla"]["kv_lora_rank"] == 128
    assert info["eval_text"].endswith("eval.txt") and info["calib_text"].endswith("calib.txt")
    assert info["quantization_config"] is None and info["size_bytes"] > 30e6
    assert info["tokenizer"]["vocab"] == 8192 and info["tokenizer"]["chat_template"] is True


def test_info_says_when_the_tokenizer_does_not_load_or_has_no_chat_template(tmp_path, capsys):
    """info loads the tokenizer, so a broken one shows before serve: one line saying why, with the rest
    of the description; generate refuses it in one line too."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(TINY_DIR, broken)
    text = (broken / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[:1000])  # truncated
    assert main(["info", str(broken), "--json"]) == 0
    error = json.loads(capsys.readouterr().out)["tokenizer"]["error"]
    assert "cannot load the tokenizer" in error and "JSONDecodeError" in error and "\n" not in error
    (broken / "tokenizer.json").unlink()  # tokenizer_config.json alone: transformers' many-line refusal
    assert main(["generate", str(broken), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err
    (broken / "tokenizer.json").write_text(text)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (broken / name).unlink(missing_ok=True)
    assert main(["info", str(broken)]) == 0
    assert "no chat template" in " ".join(capsys.readouterr().out.split())


def test_generate_greedy_is_deterministic_and_sampling_seeded(capsys):
    args = ["generate", "--prompt", "def main():", "--max-tokens", "12"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first and len(first) > len("def main():") + 5
    main(args + ["--temperature", "1.0", "--seed", "7"])
    a = capsys.readouterr().out
    main(args + ["--temperature", "1.0", "--seed", "7"])
    assert capsys.readouterr().out == a


@pytest.mark.parametrize("bad", [["--max-tokens", "0"], ["--top-p", "1.5"], ["--temperature", "-1"]])
def test_generate_rejects_bad_options(bad, capsys):
    assert main(["generate", "--prompt", "x", *bad]) == 2
    assert "error" in capsys.readouterr().err


def test_hub_ids_are_not_fetched(capsys):
    assert main(["info", "deepseek-ai/DeepSeek-V3"]) == 2
    assert "never downloads" in capsys.readouterr().err


def test_demo_runs_offline(demo_run):
    proc, work = demo_run
    assert proc.returncode == 0, proc.stderr
    assert "DeepseekV3ForCausalLM" in proc.stdout and "def fibonacci(n):" in proc.stdout
    assert "tiny-w4a16-gptq" in proc.stdout and "top-1 agreement" in proc.stdout
    rows = json.loads((work / "fidelity.json").read_text())
    assert [r["checkpoint"] for r in rows] == ["tiny-w4a16-rtn", "tiny-w4a16-gptq", "tiny-w4a16-awq", "tiny-w8a16-rtn"]
    for r in rows:  # the JSON holds the figures the table printed
        assert f"{r['kl_mean']:.4f}" in proc.stdout and (work / r["checkpoint"] / "config.json").is_file()
    assert (work / "report-w4a16-gptq" / "report.html").is_file() and "POST http" in proc.stdout
