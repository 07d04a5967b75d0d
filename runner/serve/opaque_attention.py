"""A diffusers-hooked attention module as one opaque op for Dynamo (used by step_cache.apply).

A hook method (fastercache, pab) decides per call in Python whether to compute or reuse. Under
per-block torch.compile the hooked module becomes one custom op, `runner_step_cache::hooked_attention`,
so the compiled graph stays the same whatever the hook decides, and every hooked module of a block
type shares one graph. Worker side only: this module imports torch (the driver's step_cache does not).
"""
from __future__ import annotations

import weakref

import torch


# key buffer's data_ptr -> hooked attention module. Weak: a strong entry kept every hooked module
# alive for the life of the process, and through its hook's timestep reader the whole pipeline
# (11.3 GiB of Latte-1 left on the GPU after a fastercache test); an entry goes with its module.
_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()


@torch.library.custom_op("runner_step_cache::hooked_attention", mutates_args=())
def _hooked_attention(key: torch.Tensor, hidden_states: torch.Tensor,
                      encoder_hidden_states: torch.Tensor | None,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    m = _MODULES[key.data_ptr()]
    out = m._step_cache_forward(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                attention_mask=attention_mask)
    # A fresh tensor: the hook keeps `out` as its cache, and Inductor may reuse an op's output
    # buffer in place (the residual add after attention).
    return out.clone()


@_hooked_attention.register_fake
def _(key, hidden_states, encoder_hidden_states, attention_mask):
    return torch.empty_like(hidden_states)   # self-attention: out_proj maps back to the input width


def _opaque_forward(module, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
    if kw:
        raise TypeError(f"step cache: unexpected attention arguments {sorted(kw)}")
    if torch.compiler.is_compiling():
        return _hooked_attention(module._step_cache_key, hidden_states, encoder_hidden_states,
                                 attention_mask)
    return module._step_cache_forward(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                      attention_mask=attention_mask)


def make_opaque(m: torch.nn.Module) -> None:
    # Count calls, and the calls that ran the attention (the hook calls `original_forward` then),
    # so `skipped` can say how much the cache actually reused.
    ref = m._diffusers_hook._fn_refs[-1]
    original = ref.original_forward
    m._step_cache_calls = m._step_cache_computed = 0

    def computed(*a, **kw):
        m._step_cache_computed += 1
        return original(*a, **kw)

    hooked = m.forward   # diffusers' hook chain

    def counted(*a, **kw):
        m._step_cache_calls += 1
        return hooked(*a, **kw)

    ref.original_forward = computed
    m._step_cache_forward = counted
    m.register_buffer("_step_cache_key", torch.zeros(1, device=next(m.parameters()).device),
                      persistent=False)
    _MODULES[m._step_cache_key.data_ptr()] = m
    # The class, not the instance, carries the opaque forward: Dynamo guards on the identity of an
    # instance's own `forward` (one per module: a recompile per block pair, past Dynamo's limit at
    # Latte-1's 28 pairs) but on the type of a class's, which every hooked attention shares.
    del m.forward
    m.__class__ = _opaque_class(type(m))


_OPAQUE: dict[type, type] = {}


def _opaque_class(cls: type) -> type:
    if cls not in _OPAQUE:
        _OPAQUE[cls] = type(f"StepCached{cls.__name__}", (cls,), {"forward": _opaque_forward})
    return _OPAQUE[cls]
