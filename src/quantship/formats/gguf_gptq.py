"""`export --format gguf --method gptq`: GPTQ whose rounding grid is the GGUF type's own blocks.

The layer loop of quant/pipeline.py, for a GGUF file: stream one decoder layer, collect the input
Hessian of every Linear on calibration text (routed experts get the every-token statistics when
too few tokens reach them, as in quantize), round each tensor onto its type's grid with
quant/gptq_grid.py, then run the layer with the rounded weights to make the next layer's inputs.
The grids, fitted per block from the error-updated weights:
- Q4_0/Q5_0: d = (the signed largest value) / -8 (-16), like llama.cpp; Q4_1/Q5_1: d = (max - min) / 15
  (31), m = min; Q8_0: d = max|x| / 127; all with d (and m) rounded to f16 before rounding the values;
- Q4_K / Q5_K / Q6_K: the super-block's sub-block scales and mins from gguf_blocks.k_quant_params.
Which tensors get GPTQ: every Linear of the decoder layers (routed experts stacked, each with its own
Hessian); attn_k_b too, as llama.cpp uses it: its rows are multiplied by each head's no-rope query, so
each head's slice gets the Hessian of that head's q_nope (collected at the query projection's output);
and the output matrix, with the Hessian of the final normed hidden states, written last in the file
so that the whole model has run by then. Rounded to nearest as without --method gptq: token_embd
(a lookup: no inputs, so no Hessian; unless tied to the output, then it is the output matrix), and
any tensor whose type is off these grids (F16/BF16/F32 fallbacks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from quantship.errors import QuantshipError
from quantship.formats import gguf_blocks as blocks
from quantship.formats.gguf_layout import ours_from_gguf
from quantship.models.bundled import TINY_DIR
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.calibrate import calibration_tokens, collect_stats
from quantship.quant.gptq_grid import GridBlock, gptq_on_grid

GPTQ_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
MIN_EXPERT_TOKENS = 16


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


def _fit(qtype: T):
    """The fit callback for gptq_on_grid: rows [M, width] → GridBlock."""

    def legacy(x: torch.Tensor) -> GridBlock:
        width = x.shape[1]
        if qtype in (T.Q4_0, T.Q5_0):
            half = 8 if qtype == T.Q4_0 else 16
            pick = torch.gather(x, 1, x.abs().argmax(-1, keepdim=True))[:, 0]
            d = _f16(pick / -half)
            return GridBlock(d[:, None].expand(-1, width), (half * d)[:, None].expand(-1, width), 0, 2 * half - 1,
                             {"d": d})
        if qtype in (T.Q4_1, T.Q5_1):
            top = 15 if qtype == T.Q4_1 else 31
            low, high = x.amin(-1), x.amax(-1)
            d, m = _f16((high - low) / top), _f16(low)
            return GridBlock(d[:, None].expand(-1, width), (-m)[:, None].expand(-1, width), 0, top, {"d": d, "m": m})
        d = _f16(x.abs().amax(-1) / 127)
        return GridBlock(d[:, None].expand(-1, width), torch.zeros_like(x), -127, 127, {"d": d})

    def k_quant(x: torch.Tensor) -> GridBlock:
        params = blocks.k_quant_params(x, qtype)
        if qtype == T.Q6_K:
            step = (params["d"][:, None] * params["sc"]).repeat_interleave(16, dim=1)
            return GridBlock(step, 32 * step, 0, 63, params)
        step = (params["d"][:, None] * params["sc"]).repeat_interleave(32, dim=1)
        low = (params["dmin"][:, None] * params["mn"]).repeat_interleave(32, dim=1)
        return GridBlock(step, low, 0, 15 if qtype == T.Q4_K else 31, params)

    return k_quant if qtype in blocks.K_TYPES else legacy


def _pack(qtype: T, codes: torch.Tensor, fitted: list[GridBlock]) -> np.ndarray:
    """codes [M, n] and the fitted blocks (in column order, each for all M rows) → bytes [M, ...]."""
    m, n = codes.shape
    params = {k: torch.stack([f.params[k] for f in fitted], dim=1) for k in fitted[0].params}  # [M, blocks, ...]
    if qtype in blocks.K_TYPES:
        flat = {k: v.reshape(m * len(fitted), *v.shape[2:]) for k, v in params.items()}
        return blocks.pack_k(codes.reshape(-1, blocks.QK_K), flat, qtype).reshape(m, -1)
    if qtype == T.Q4_0:
        return blocks.pack_q4_0((codes - 8).to(torch.int8), params["d"])
    if qtype == T.Q4_1:
        return blocks.pack_q4_1_codes(codes, params["d"], params["m"])
    if qtype in (T.Q5_0, T.Q5_1):
        return blocks.pack_q5(codes, params["d"], params.get("m"))
    return blocks.pack_q8_0(codes.to(torch.int8), params["d"])


def gptq_tensor(weights: torch.Tensor, hessians: torch.Tensor, qtype: T, dampening: float) -> np.ndarray:
    """weights [B, R, n] (B experts or 1) with their Hessians [B, n, n] → GGUF bytes [B, R, ...]."""
    b, r, n = weights.shape
    codes, _, fitted = gptq_on_grid(weights, hessians, blocks.block_size(qtype), _fit(qtype), dampening)
    return _pack(qtype, codes.reshape(b * r, n), fitted).reshape(b, r, -1)


def _hessian(stats, name: str) -> torch.Tensor | None:
    chosen = stats.routed[name]
    if name in stats.all_tokens and chosen.tokens < MIN_EXPERT_TOKENS:
        chosen = stats.all_tokens[name]  # a starved expert borrows the every-token statistics
    return chosen.hessian


def output_matrix(config) -> str:
    """The GGUF name of the matrix that makes the logits (the embeddings when they are tied)."""
    return "token_embd.weight" if config.tie_word_embeddings else "output.weight"


def output_last(plan: list, config) -> list:
    """The plan with the output matrix moved to the end of the file (llama.cpp finds tensors by name)."""
    head = output_matrix(config)
    return [p for p in plan if p.spec.name != head] + [p for p in plan if p.spec.name == head]


class _QueryHessians:
    """Per-head Hessians [H, nope, nope] of the no-rope query, from the query projection's output."""

    def __init__(self, attn):
        self.heads, self.nope = attn.heads, attn.nope
        self.sum = torch.zeros(self.heads, self.nope, self.nope)
        module = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
        self.handle = module.register_forward_hook(lambda _m, _inp, out: self.add(out))

    def add(self, q: torch.Tensor) -> None:
        q_nope = q.float().reshape(-1, self.heads, q.shape[-1] // self.heads)[..., : self.nope]
        self.sum += torch.einsum("thi,thj->hij", q_nope, q_nope)


def _gptq_or_rtn(p, ref, hessians, tensors, config, opts, encode, done: set):
    if p.how == "quantized" and p.qtype in GPTQ_TYPES and hessians and all(h is not None for h in hessians):
        done.add(p.spec.name)
        stacked = ref.reshape(len(hessians), -1, ref.shape[-1])  # experts or heads, each with its Hessian
        data = gptq_tensor(stacked, torch.stack(hessians), p.qtype, opts.dampening)
        return data.reshape(*p.spec.shape[:-1], -1)
    return encode(p, tensors, config, ref)


def gptq_tensors(ck, plan, opts, done: set | None = None):
    """Yields (planned tensor, GGUF bytes, float reference) in file order, like gguf._rtn_tensors; the
    plan must have the output matrix last (output_last). Adds the names of the tensors GPTQ rounded to `done`."""
    done = set() if done is None else done
    from quantship.formats.gguf import encode, reference, source_layers
    from quantship.models.layers import RMSNorm

    calib = Path(opts.calib) if opts.calib else TINY_DIR / "calib.txt"
    tokens, _ = calibration_tokens(calib, load_tokenizer(ck.path), opts.samples, opts.seq_len)
    positions = torch.arange(tokens.shape[1])
    hidden, final_norm = None, None
    head = output_matrix(ck.config)
    layers = source_layers(ck)
    for index, tensors in layers:
        group = [p for p in plan if p.spec.layer == index and p.spec.name != head]
        if index is None:
            hidden = torch.nn.functional.embedding(tokens, tensors["model.embed_tokens.weight"].float())
            final_norm = tensors["model.norm.weight"].float()
            for p in group:
                ref = reference(p, tensors, ck.config)
                yield p, encode(p, tensors, ck.config, ref), ref
            continue
        layer = ck.layer(index, dtype=torch.float32)
        queries = _QueryHessians(layer.self_attn) if ck.config.is_mla else None
        try:
            # (a MoE layer's every-token pass runs the attention again: the query sums double, which
            # GPTQ does not see, as its dampening is relative to the Hessian's own diagonal)
            stats = collect_stats(layer, hidden, positions, want_hessian=True)
        finally:
            if queries is not None:
                queries.handle.remove()
        rounded = {}
        for p in group:
            ref = reference(p, tensors, ck.config)
            prefix = f"model.layers.{index}."
            if p.how != "quantized":
                hessians = []
            elif p.spec.transform == "k_b":
                hessians = list(queries.sum.unbind(0))  # one per head: the rows of its [rank, nope] slice
            else:
                hessians = [_hessian(stats, s[len(prefix):-len(".weight")]) for s in p.spec.sources]
            data = _gptq_or_rtn(p, ref, hessians, tensors, ck.config, opts, encode, done)
            rounded[p.spec.name] = blocks.dequantize(data, p.qtype).reshape(p.spec.shape)
            yield p, data, ref
        # The next layer sees this one as the file will compute it.
        state = ours_from_gguf([p.spec for p in group], rounded)
        prefix = f"model.layers.{index}."
        _, unexpected = layer.load_state_dict({k[len(prefix):]: v for k, v in state.items()}, strict=False)
        if unexpected:
            raise QuantshipError(f"internal: GGUF tensors without a module: {unexpected[:3]}")
        with torch.no_grad():
            hidden = torch.cat([layer(hidden[s:s + 8], positions) for s in range(0, hidden.shape[0], 8)])
    # The output matrix, on the final hidden states as the quantized layers made them.
    norm = RMSNorm(ck.config.hidden_size, ck.config.rms_norm_eps)
    norm.weight.data = final_norm
    with torch.no_grad():
        x = norm(hidden.reshape(-1, hidden.shape[-1]))
    for p in [p for p in plan if p.spec.name == head]:
        tensors = ck.read(list(p.spec.sources))
        ref = reference(p, tensors, ck.config)
        yield p, _gptq_or_rtn(p, ref, [x.T @ x], tensors, ck.config, opts, encode, done), ref
