"""The forward pass: one run of the model over the corpus, with hooks that collect Q, K and V.

Forward hooks on each selected layer's ``q_proj``/``k_proj``/``v_proj`` (``q_norm``/``k_norm`` where the
model normalizes before RoPE) collect the pre-RoPE activations, a hook on the shared rotary embedding
collects ``cos``/``sin``, and the post-RoPE keys and the values are read from the cache the model returns —
the model and its attention are left as they are. With gradients, the K and V activations are replaced by
leaves so that the backward pass of the LM loss keeps their gradients.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from kvqbench.data.capture.loading import _model_for_capture
from kvqbench.data.capture.models import _ModelRef, _torch_dtype
from kvqbench.data.corpus import corpus_sha256, corpus_text
from kvqbench.data.types import KVData, apply_rope


def _layer_spec(layers: Any) -> Any:
    """JSON-able form of the ``layers`` argument (validated for type), used in disk-cache keys."""
    if layers is None:
        return "all"
    if isinstance(layers, slice):
        for part in (layers.start, layers.stop, layers.step):
            if part is not None and (not isinstance(part, int) or isinstance(part, bool)):
                raise TypeError(f"layers slice bounds must be ints or None, got {layers!r}")
        return {"slice": [layers.start, layers.stop, layers.step]}
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be None, a slice or a sequence of ints, got {layers!r}")
    out = list(layers)
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"layer indices must be ints, got {i!r} in {layers!r}")
    return out


def _layer_indices(layers: Any, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, slice):
        idx = list(range(n_layers))[layers]
    else:
        idx = []
        for i in layers:
            if not -n_layers <= i < n_layers:
                raise ValueError(f"layer index {i} out of range for a model with {n_layers} layers")
            idx.append(i % n_layers)
    if not idx:
        raise ValueError(f"layers {layers!r} selects no layer of the model's {n_layers}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"layers {layers!r} selects a layer twice")
    return idx


def _tokens(tokenizer: Any, seq_len: int) -> tuple[list[int], int]:
    """The first ``seq_len`` token ids of the corpus, repeating it when it is too short."""
    repeats = 1
    while True:
        ids = list(tokenizer(corpus_text(repeats))["input_ids"])
        if len(ids) >= seq_len:
            return ids[:seq_len], repeats
        per_copy = max(len(ids) // repeats, 1)
        repeats = max(repeats + 1, -(-seq_len // per_copy) + 1)


# --------------------------------------------------------------------------------------------------
# the capture


def _config_dims(cfg: Any) -> tuple[int, int, int, int]:
    n_layers = int(cfg.num_hidden_layers)
    q_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads)
    return n_layers, q_heads, kv_heads, head_dim


def _decoder(net: Any) -> Any:
    inner = net.get_decoder() if hasattr(net, "get_decoder") else getattr(net, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise ValueError(
            f"unsupported architecture {type(net).__name__}: expected a decoder with `.layers` and a "
            "shared `.rotary_emb` (Llama-style)"
        )
    return inner


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)  # transformers >= 5 renamed `past_key_values` to `cache`
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("the model returned no KV cache (use_cache=True was ignored)")
    return cache


def _cached_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers ≥ 4.56: DynamicCache.layers[i].keys / .values
        return layers[i].keys, layers[i].values
    if hasattr(cache, "key_cache"):  # older DynamicCache
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]  # legacy tuple of (k, v)


def _heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """``(1, T, H*D)`` or ``(1, T, H, D)`` hook output → ``(H, T, D)``."""
    t = x.shape[1]
    return x.reshape(1, t, n_heads, head_dim).transpose(1, 2)[0]


def _run_capture(
    ref: _ModelRef, seq_len: int, layers: Any, with_grads: bool, dev: torch.device, dtype: str = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
) -> KVData:
    import transformers

    net, tokenizer = _model_for_capture(ref, str(dev), _torch_dtype(dtype), cache_dir)
    n_layers, q_heads, kv_heads, head_dim = _config_dims(net.config)
    max_pos = getattr(net.config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > int(max_pos):
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's context ({max_pos} positions, max_position_embeddings)"
        )
    idx = _layer_indices(layers, n_layers)
    ids, repeats = _tokens(tokenizer, seq_len)
    decoder = _decoder(net)

    grabbed: dict[tuple[str, int], torch.Tensor] = {}
    rope: list[tuple[torch.Tensor, torch.Tensor]] = []

    def grab(key: tuple[str, int], leaf: bool):
        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
            if leaf:  # replace the activation by a leaf so its gradient is kept
                output = output.detach().requires_grad_(True)
                grabbed[key] = output
                return output
            grabbed[key] = output.detach()
            return None

        return hook

    def grab_rope(module: Any, args: Any, output: Any) -> None:
        rope.append((output[0].detach(), output[1].detach()))

    handles = [decoder.rotary_emb.register_forward_hook(grab_rope)]
    try:
        for i in idx:
            attn = getattr(decoder.layers[i], "self_attn", None)
            if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
                raise ValueError(
                    f"unsupported architecture {type(net).__name__}: layer {i} has no self_attn with "
                    "separate q_proj/k_proj/v_proj"
                )
            q_src = getattr(attn, "q_norm", None)
            k_src = getattr(attn, "k_norm", None)
            q_src = attn.q_proj if q_src is None else q_src
            k_src = attn.k_proj if k_src is None else k_src
            handles.append(q_src.register_forward_hook(grab(("q", i), False)))
            handles.append(k_src.register_forward_hook(grab(("k", i), with_grads)))
            handles.append(attn.v_proj.register_forward_hook(grab(("v", i), with_grads)))

        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(seq_len, device=dev)[None],
            "use_cache": True,
        }
        loss_nats = None
        if with_grads:
            with torch.enable_grad():
                out = net(**kwargs, labels=input_ids)
                out.loss.backward()
            loss_nats = float(out.loss.detach())
        else:
            if "logits_to_keep" in inspect.signature(net.forward).parameters:
                kwargs["logits_to_keep"] = 1  # the logits are not needed; skip the vocab matmul
            with torch.no_grad():
                out = net(**kwargs)
        cache = _returned_cache(out)
    finally:
        for h in handles:
            h.remove()

    if len(rope) != 1:
        raise ValueError(f"expected one call of the model's rotary embedding, saw {len(rope)}")
    cos, sin = (t[0].float() for t in rope[0])
    if cos.shape != (seq_len, head_dim):
        raise ValueError(
            f"unsupported RoPE: tables of shape {tuple(cos.shape)}, expected ({seq_len}, {head_dim}) "
            "(partial-rotary models are not supported)"
        )

    ks, vs, qs, kps, kg2, vg2 = [], [], [], [], [], []
    for i in idx:
        k_c, v_c = _cached_kv(cache, i)
        if tuple(k_c.shape) != (1, kv_heads, seq_len, head_dim):
            raise ValueError(
                f"cached keys of layer {i} have shape {tuple(k_c.shape)}, expected "
                f"(1, {kv_heads}, {seq_len}, {head_dim})"
            )
        ks.append(k_c[0].detach().float())
        vs.append(v_c[0].detach().float())
        k_pre = _heads(grabbed[("k", i)].detach().float(), kv_heads, head_dim)
        kps.append(k_pre)
        qs.append(apply_rope(_heads(grabbed[("q", i)].float(), q_heads, head_dim)[None], cos, sin)[0])
        if with_grads:
            for src, dst, n_h in ((("k", i), kg2, kv_heads), (("v", i), vg2, kv_heads)):
                grad = grabbed[src].grad
                g = torch.zeros_like(grabbed[src]) if grad is None else grad
                dst.append(_heads(g.detach().float(), n_h, head_dim).square())

    def stack(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).contiguous()

    k, v, q, k_pre = stack(ks), stack(vs), stack(qs), stack(kps)
    rope_err = float((apply_rope(k_pre, cos, sin) - k).abs().max())
    # fp32: rounding only; bf16/fp16: the model rotates in its own dtype, we rotate its (rounded) k_proj
    # output in fp32, so a few units of the dtype's epsilon apart
    tol = max(1e-4, 4 * torch.finfo(_torch_dtype(dtype)).eps) * (1.0 + float(k.abs().max()))
    if not rope_err <= tol:
        raise ValueError(
            f"unsupported positional encoding: rotating the k_proj output with the model's cos/sin does "
            f"not reproduce the cached keys (max abs error {rope_err:.3g} > {tol:.3g}); only rotate-half "
            "RoPE over the full head is supported"
        )

    text_sha = hashlib.sha256(corpus_text(repeats).encode("utf-8")).hexdigest()
    meta = {
        "model": ref.name,
        "model_file": ref.gguf_file,
        "architecture": type(net).__name__,
        "n_layers": n_layers,
        "layers": idx,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seq_len": seq_len,
        "text": "kvqbench/data/corpus.txt",
        "corpus_sha256": corpus_sha256(),
        "corpus_repeats": repeats,
        "text_sha256": text_sha,
        "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "k_pre_source": "k_norm" if getattr(decoder.layers[idx[0]].self_attn, "k_norm", None) is not None
        else "k_proj",
        "rope_max_abs_err": rope_err,
        "with_grads": with_grads,
        "lm_loss_nats": loss_nats,
        "dtype": "float32",
        "capture_dtype": dtype,
        "device_type": dev.type,
        "attn_implementation": getattr(net.config, "_attn_implementation", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    return KVData(
        "real",
        k,
        v,
        q.contiguous(),
        k_pre=k_pre,
        cos=cos.contiguous(),
        sin=sin.contiguous(),
        k_grad2=stack(kg2) if with_grads else None,
        v_grad2=stack(vg2) if with_grads else None,
        meta=meta,
    )

