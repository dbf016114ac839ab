"""An independent, plain-PyTorch LLaMA forward with EPAS sharing, written from the method's
definition (not from the model code): RMSNorm, RoPE (rotate-half), GQA causal attention, SwiGLU.

A layer in ``sharing`` takes the post-RoPE Q and K ('qk') or K and V ('kv') of the last computing
layer before it; weights are full tensors: q/k/v/o [out, in], gate/up/down, norms, embedding, head.
"""

import math

import torch


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, base, positions=None):
    # x [b, heads, s, hn]; positions [b, s] (default 0..s-1)
    s, hn = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn))
    if positions is None:
        positions = torch.arange(s).unsqueeze(0)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [b, s, hn/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [b, 1, s, hn]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hn // 2], x[..., hn // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def attention(q, k, v):
    # q [b, np, s, hn], k/v [b, ng, s, hn]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def heads(x, n):
    b, s, _ = x.shape
    return x.view(b, s, n, -1).transpose(1, 2)


def layer_forward(L, x, np_, ng, shared, sharing, share, eps, base, positions=None, blend=None):
    """One decoder layer over x [b, s, h] at ``positions``; returns (x, the Q/K or K/V it hands on).
    ``blend`` (a computing layer of a blended switch): its Q/K (K/V) are ``(1 - blend)`` times its
    own plus ``blend`` times the incoming ones, and it hands that blend on."""
    xn = rms_norm(x, L["input_norm"], eps)
    if not sharing:
        q = rope(heads(xn @ L["q"].T, np_), base, positions)
        k = rope(heads(xn @ L["k"].T, ng), base, positions)
        v = heads(xn @ L["v"].T, ng)
        if blend is not None and share == "qk":
            q, k = (1 - blend) * q + blend * shared[0], (1 - blend) * k + blend * shared[1]
        elif blend is not None:
            k, v = (1 - blend) * k + blend * shared[0], (1 - blend) * v + blend * shared[1]
        shared = (q, k) if share == "qk" else (k, v)
    elif share == "qk":
        q, k = shared
        v = heads(xn @ L["v"].T, ng)
    else:
        q = rope(heads(xn @ L["q"].T, np_), base, positions)
        k, v = shared
    a = attention(q, k, v)
    b, _, s, _ = a.shape
    x = x + a.transpose(1, 2).reshape(b, s, -1) @ L["o"].T
    xn = rms_norm(x, L["mlp_norm"], eps)
    x = x + (torch.nn.functional.silu(xn @ L["gate"].T) * (xn @ L["up"].T)) @ L["down"].T
    return x, shared


def forward(w, tokens, num_layers, np_, ng, sharing=(), share="qk", eps=1e-5, base=10000, kept=None, blend=None):
    """Logits [b, s, vocab] for a LLaMA model with the given sharing layers (``blend``: {computing
    layer: its weight on the incoming Q/K}, see :func:`layer_forward`).

    ``kept`` (Random-LTD): {layer: [b, r] sorted positions}; such a layer runs, sequence by
    sequence, on its kept tokens only -- as a sequence of r tokens at their original positions,
    causal among themselves, a sharing layer with the hand-off's rows at those positions -- and
    the other tokens pass it unchanged. A source (the computing layer before the sharing layers)
    computes Q, K and V for every token, hands on the whole sequence's, and attends with its
    kept tokens' rows."""
    x = w["embed"][tokens]
    shared = None
    kept = kept or {}
    for i in range(num_layers):
        L = w["layers"][i]
        if i not in kept:
            x, shared = layer_forward(L, x, np_, ng, shared, i in sharing, share, eps, base, blend=(blend or {}).get(i))
            continue
        rows = []
        if i not in sharing and i + 1 in sharing:  # a dropping source
            xn = rms_norm(x, L["input_norm"], eps)
            q = rope(heads(xn @ L["q"].T, np_), base)
            k = rope(heads(xn @ L["k"].T, ng), base)
            v = heads(xn @ L["v"].T, ng)
            shared = (q, k) if share == "qk" else (k, v)
            for j, index in enumerate(kept[i]):
                a = attention(q[j:j + 1, :, index], k[j:j + 1, :, index], v[j:j + 1, :, index])
                h = x[j:j + 1, index] + a.transpose(1, 2).reshape(1, len(index), -1) @ L["o"].T
                hn = rms_norm(h, L["mlp_norm"], eps)
                rows.append((index, (h + (torch.nn.functional.silu(hn @ L["gate"].T) * (hn @ L["up"].T)) @ L["down"].T)[0]))
        for j, index in enumerate(kept[i] if not rows else []):
            mine = None if shared is None else tuple(t[j:j + 1, :, index] for t in shared)
            out, handed = layer_forward(L, x[j:j + 1, index], np_, ng, mine, i in sharing, share, eps, base, index.unsqueeze(0))
            rows.append((index, out[0]))
        x = x.clone()
        for j, (index, out) in enumerate(rows):
            x[j, index] = out
    return rms_norm(x, w["final_norm"], eps) @ w["head"].T


def weights_from_hf_style(hf: dict, num_layers: int) -> dict:
    """Reference weights from a Hugging Face-named state dict (see epas_megatron.convert)."""
    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        layers.append({
            "q": hf[p + "self_attn.q_proj.weight"], "k": hf[p + "self_attn.k_proj.weight"],
            "v": hf[p + "self_attn.v_proj.weight"], "o": hf[p + "self_attn.o_proj.weight"],
            "gate": hf[p + "mlp.gate_proj.weight"], "up": hf[p + "mlp.up_proj.weight"],
            "down": hf[p + "mlp.down_proj.weight"], "input_norm": hf[p + "input_layernorm.weight"],
            "mlp_norm": hf[p + "post_attention_layernorm.weight"],
        })
    return {"embed": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"],
            "head": hf["lm_head.weight"], "layers": layers}
