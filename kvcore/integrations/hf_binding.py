"""Binding a transformers model to a paged cache: attention implementation and hooks.

Once per model (reference-counted over the caches bound to it):

* ``kvcore+<original>`` is registered in transformers' ``AttentionInterface``
  and ``AttentionMaskInterface`` and set as the model's attention
  implementation. During a forward whose ``cache`` is the bound cache type, the
  attention function hands the query to ``cache.attend`` and the mask function
  returns None (the pages hold only real tokens; the kernels are causal). In
  any other forward both fall back to ``<original>`` (``sdpa`` when the original
  is not in the registry, e.g. ``eager``), so a DynamicCache run of a bound
  model is transformers' own.
* ``model.forward`` is wrapped (an instance attribute over the previous one):
  a forward whose ``cache`` is the bound cache type calls
  ``cache.begin(args, kwargs)`` (which may rewrite the inputs), runs with the
  cache marked active in this thread, and always ends with
  ``cache.end(failed)``: ``failed`` is True when begin or the forward raised
  anything, a KeyboardInterrupt included (torch's always-called forward hooks
  run only on ``Exception``, which would leave a step half-alive).
* MLA modules (DeepseekV2Attention) get an instance ``forward`` that, during such
  a forward, computes in absorbed form over the latent pages
  (:mod:`kvcore.integrations.hf_mla`), and is the module's own otherwise.

The last :func:`detach` restores the previous ``forward`` (unless something wrapped
it again since; the wrapper then passes through), the original implementation and
the MLA modules' forwards.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, cast

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kvcore.backend import Attention
from kvcore.errors import Unsupported
from kvcore.integrations import hf_mla

_ACTIVE = threading.local()  # .cache: the paged cache of the forward running in this thread


class Forward(Protocol):
    """What a bound cache does around each forward of the model."""

    def begin(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]: ...

    def end(self, failed: bool) -> None: ...

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        scale: float,
        attention: Attention | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor: ...


def attach(model: torch.nn.Module, cache_type: type) -> None:
    """Bind ``model`` (or count one more cache on it); ``cache_type`` is a Forward class."""
    _Binding.attach(model, cache_type)


def detach(model: torch.nn.Module) -> None:
    """One cache less on ``model``; the last one unbinds it."""
    _Binding.detach(model)


class _Binding:
    """Per model: how many caches are bound, the forward wrapper, what to restore."""

    _by_model: ClassVar[weakref.WeakKeyDictionary[torch.nn.Module, _Binding]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, original: str, cache_type: type) -> None:
        self.original = original  # the implementation to restore
        self.cache_type = cache_type
        self.count = 0  # caches bound to the model
        self.bound = True  # False once detached: a wrapper left in place passes through
        self.saved_forward: Any = None  # the instance attribute ``forward`` we covered, if any
        self.wrapper: Any = None
        self.unbind_mla: Callable[[], None] = lambda: None  # undoes hf_mla.bind

    @classmethod
    def attach(cls, model: torch.nn.Module, cache_type: type) -> None:
        binding = cls._by_model.get(model)
        if binding is None:
            config: Any = model.config
            binding = cls(str(config._attn_implementation), cache_type)
            model.set_attn_implementation(_register(binding.original))  # type: ignore[operator]
            binding.saved_forward = model.__dict__.get("forward")
            binding.wrapper = binding.wrap(model.forward)
            model.forward = binding.wrapper
            binding.unbind_mla = hf_mla.bind(model, _active)
            cls._by_model[model] = binding
        elif binding.cache_type is not cache_type:
            raise Unsupported(f"the model is bound to {binding.cache_type.__name__} caches")
        binding.count += 1

    @classmethod
    def detach(cls, model: torch.nn.Module) -> None:
        binding = cls._by_model.get(model)
        if binding is None:
            return
        binding.count -= 1
        if binding.count == 0:
            binding.bound = False
            if model.__dict__.get("forward") is binding.wrapper:
                if binding.saved_forward is None:
                    del model.forward
                else:
                    model.forward = binding.saved_forward
            binding.wrapper = binding.saved_forward = None
            binding.unbind_mla()
            model.set_attn_implementation(binding.original)  # type: ignore[operator]
            del cls._by_model[model]

    def _cache_of(self, kwargs: dict[str, Any]) -> Forward | None:
        if not self.bound:
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return cast("Forward", cache) if isinstance(cache, self.cache_type) else None

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` run as one step of its cache: begin, the forward, end (always)."""

        @functools.wraps(forward)  # generate reads the signature through __wrapped__
        def step(*args: Any, **kwargs: Any) -> Any:
            cache = self._cache_of(kwargs)
            _ACTIVE.cache = None
            if cache is None:
                return forward(*args, **kwargs)
            failed = True
            try:
                args, kwargs = cache.begin(args, kwargs)
                _ACTIVE.cache = cache
                output = forward(*args, **kwargs)
                failed = False
            finally:  # any BaseException, KeyboardInterrupt included, fails the step
                _ACTIVE.cache = None
                cache.end(failed)
            return output

        return step


def _active() -> Any:
    """The paged cache of the forward running in this thread, or None."""
    return getattr(_ACTIVE, "cache", None)


def options(sliding_window: int | None, softcap: float | None, sinks: bool) -> Attention:
    """The kernels' :class:`~kvcore.backend.Attention` of what transformers passes an
    attention function: ``sliding_window`` W (a query attends its last W tokens, itself
    included: ``window_left`` W - 1), ``softcap`` (Gemma 2's logit soft-capping) and
    whether it passes ``s_aux`` (gpt-oss's attention sinks, one logit per head)."""
    return Attention(
        window_left=sliding_window - 1 if sliding_window else -1,
        logits_soft_cap=float(softcap) if softcap else 0.0,
        sinks=sinks,
    )


def _register(original: str) -> str:
    """Register ``kvcore+<original>`` (attention and mask) once; return its name."""
    if original.startswith("kvcore+"):
        return original
    name = f"kvcore+{original}"
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    base = original if original in ALL_ATTENTION_FUNCTIONS else "sdpa"
    fallback: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS[base]
    fallback_mask: Callable[..., Any] = ALL_MASK_ATTENTION_FUNCTIONS[base]

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cache: Forward | None = getattr(_ACTIVE, "cache", None)
        if cache is None:
            result: tuple[torch.Tensor, None] = fallback(
                module, query, key, value, attention_mask, scaling=scaling, **kwargs
            )
            return result
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        layer_idx: int = module.layer_idx  # type: ignore[assignment]
        sinks = kwargs.get("s_aux")
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        attention = None  # plain attention: the cache's own options
        if sinks is not None or window or softcap:
            attention = options(window, softcap, sinks is not None)
        if sinks is not None:
            sinks = sinks.float()
        return cache.attend(layer_idx, query, scale, attention, sinks), None

    def mask(*args: Any, **kwargs: Any) -> Any:
        if getattr(_ACTIVE, "cache", None) is not None:
            return None  # the pages hold only real tokens; the kernels are causal
        return fallback_mask(*args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name
