"""A transformers ``Cache`` whose K/V live in a kvcore pool (extra ``hf``).

Usage::

    client = kvcore.Client.connect(endpoint, pool="default", namespace="my-app")
    with KVCoreCache(client, model) as cache:          # binds to the model
        out = model.generate(input_ids, attention_mask=mask, cache=cache,
                             max_new_tokens=32)          # past_key_values= works too
    cache.num_cached_tokens                             # prompt tokens served from the pool
    cache.cached_tokens_by_source                       # of those, by medium: {"pool": 32, ...}

Contract (transformers 5.x, decoder-only models whose attention modules call
``cache.update`` and then the attention interface, e.g. Llama, Mistral, Qwen2):

* Binding. The cache switches ``model``'s attention implementation to
  ``"kvcore+<original>"`` and wraps ``model.forward`` (hf_binding). Forwards whose ``cache`` is a KVCoreCache run
  kvcore's paged kernels; every other forward (a DynamicCache run of the same
  model) falls back to the original implementation (``sdpa`` when the original
  is not in transformers' registry, e.g. ``eager``). The last cache bound to a
  model restores it on :meth:`close`.
* Storage. Each forward plans its kernels once (the backend's ``plan_decode``
  for one new token per row, else ``plan_prefill``, with the step's slots and
  copy-on-write pairs: one device sync per forward). ``update`` writes each
  layer's new K/V into the sequences' pages with ``write_kv`` and returns them
  unchanged; the registered attention function reads the pages with ``decode``
  or ``prefill`` of that plan: nothing dense is kept, nothing is concatenated,
  and no layer synchronises.
* Prefix reuse. The first forward allocates every row in the daemon; rows whose
  leading full pages are committed in the cache's key space get a hit, and
  first forward drops the leading columns every row has cached from
  ``input_ids``/``position_ids`` (the model computes only the rest; the
  logits of that forward cover only the fed columns). Full pages are committed
  as soon as every layer has written them (at the next forward, and at close).
* Hit figures (set by the first forward, over all rows: a fork counts its group's
  hit): ``num_prompt_tokens``, the real prompt tokens; ``num_cached_tokens``, those
  served from the prefix cache; ``cached_tokens_by_source``, the same tokens by where
  they were when the daemon was asked: "pool" (the pool itself), or the lower tier
  that brought them up ("host", "disk", "remote"; only media with tokens; a pool
  without tiers gives only "pool").
* Key space: the session's namespace and the model's identity
  (kvcore.integrations.identity.transformers_model: its config, name or path,
  dtype and a digest of its tensors and loaded PEFT adapters, taken afresh when
  the cache is built), so a page computed by other weights (a fine-tune of the
  same geometry, a random init, weights changed in place) is never a hit.
  ``model_id`` declares the model part instead and skips the digest (the same
  weights under two paths); dtype and quantization still enter.
* Batches. Left padding only (BadRequest otherwise); padding never reaches the
  pool. Rows with identical tokens, as ``num_return_sequences`` makes them, are
  forks of one sequence (pages shared, copy-on-write of the last page).
* One generate call per cache. A later forward must continue the rows: its
  ``position_ids`` (per row: the tokens held so far, then on), ``cache_position``
  and attention mask width (the columns seen so far plus the fed ones) are
  checked, and a second generate call (which restarts them) is a BadRequest
  before anything is written. Beam search, cache reordering, cropping,
  assisted decoding raise Unsupported.
* fp8 pools (``float8_e4m3fn``, ``float8_e5m2``) for a model of any float dtype:
  ``write_kv`` stores its K/V quantized (saturating, scales 1.0: transformers
  models carry no KV scales) and the kernels dequantize on load; everything else
  stays in the model's dtype. Lossy, as any fp8 cache: outputs equal transformers
  running with K/V quantized the same way (tests/test_hf_fp8.py), not its float run.
* MLA (DeepSeek-V2-style models). Their pool is of latent kind (one vector of
  kv_lora_rank + qk_rope_head_dim elements per token and layer); their attention
  modules compute in absorbed form over it (:mod:`kvcore.integrations.hf_mla`),
  every plan with ``Attention(v_head_dim=kv_lora_rank)``. A latent pool for
  another model, or a kv pool for an MLA model, is a LayoutMismatch.
* Attention variants. What the model's attention passes its attention function
  becomes the kernels' plan options (:func:`kvcore.integrations.hf_binding.options`):
  sliding windows (Gemma 2/3, gpt-oss, Mistral), logit soft-capping (Gemma 2) and
  attention sinks (gpt-oss). The forward's plan serves the layers of plain causal
  attention; each other set of options gets its own plan of the same tables, made at
  its first layer (one more device sync per forward for a hybrid model). Every
  layer keeps every page of its sequences: a window restricts what is read, not
  what is held.
* Life cycle. :meth:`close` (or leaving ``with``) commits the written full
  pages and frees every sequence. A forward that raises frees them at once
  (the cache is then spent), so a failed generate leaves nothing held; so does
  a KeyboardInterrupt (any BaseException) inside a forward.
* Sequence ids are random 63-bit ints (ids are pool-wide). The Client is
  driven from the thread that runs generate.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcore import backend as backends
from kvcore.backend import Attention
from kvcore.errors import BadRequest, LayoutMismatch, Unsupported
from kvcore.integrations import hf_binding, hf_mla
from kvcore.integrations.hit_media import add_media, media_in
from kvcore.integrations.identity import transformers_model
from kvcore.integrations.paged_rows import PagedRows, StepPlan
from kvcore.layout import FP8_DTYPES
from kvcore.prefix import KeySpace

if TYPE_CHECKING:
    from kvcore.backend import Backend, DecodePlan, PrefillPlan
    from kvcore.client import Client

__all__ = ["KVCoreCache"]


class _PagedLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's view of the cache: lengths only; the K/V are in the pool."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False
    is_sliding = False

    def __init__(self, cache: KVCoreCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._cache = weakref.ref(cache)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise Unsupported("KVCoreCache layers are written through KVCoreCache.update")

    def get_seq_length(self) -> int:
        cache = self._cache()
        return 0 if cache is None else cache.seen_columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise Unsupported("a KVCoreCache serves one generate call; make a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise Unsupported("the kvcore cache does not support beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise Unsupported("the kvcore cache cannot crop (assisted decoding, rollback)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise Unsupported("the kvcore cache cannot reshape its batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise Unsupported("the kvcore cache cannot reshape its batch")

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


class KVCoreCache(Cache):
    """K/V of one generate call in a kvcore pool; see the module docstring for the contract."""

    def __init__(
        self,
        client: Client,
        model: torch.nn.Module,
        *,
        backend: str | Backend = "torch",
        model_id: str = "",
    ) -> None:
        if not client.kv_caches:
            raise BadRequest("the client has not mapped the pool (Client.connect(map_memory=True))")
        self.client = client
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        self._kv = client.kv_caches
        self._latent = hf_mla.latent_dims(model)  # (kv_lora_rank, rope dim) of an MLA model
        _check_layout(client, model, self._latent)
        # every layer's plan options: MLA's (its V is the latent's first kv_lora_rank elements)
        self._attention = Attention(v_head_dim=self._latent[0]) if self._latent else Attention()
        self.backend.check_supported(self._kv[0], self._attention)
        self.space = KeySpace(model=transformers_model(model, model_id))  # before binding
        super().__init__(layers=[_PagedLayer(self) for _ in range(len(self._kv))])
        self.seen_columns = 0  # columns of the padded batch processed (or skipped) so far
        self.num_prompt_tokens = 0  # real prompt tokens over all rows
        self.num_cached_tokens = 0  # of those, served from the prefix cache
        self.cached_tokens_by_source: dict[str, int] = {}  # those by medium ("pool", "host", ...)
        self.rows = PagedRows(client, self._kv[0].device, self.space)
        self._plan: StepPlan | None = None
        self._kernels: DecodePlan | PrefillPlan | None = None  # the backend's plan of _plan
        self._variants: dict[Attention, DecodePlan | PrefillPlan] = {}  # other options' plans
        self._spent = False  # a forward failed or close ran: no more forwards
        self._model: torch.nn.Module | None = model
        hf_binding.attach(model, KVCoreCache)

    # -- transformers' Cache API ------------------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's K/V ([B, Hkv, q, D]) of layer ``layer_idx`` into the pages.
        On a latent pool (MLA) they are the latent's two parts, as DeepseekV2Attention
        passes them: c_kv [B, 1, q, kv_lora_rank] and k_pe [B, 1, q, rope dim]."""
        plan, kernels = self._plan, self._kernels
        if plan is None or kernels is None:
            raise BadRequest("KVCoreCache.update outside a forward of the model it is bound to")
        kv = self._kv[layer_idx]
        if kernels.copy is not None:
            self.backend.copy_pages(kernels.copy, kv)
        if self._latent is None:
            key, value = _token_rows(key_states), _token_rows(value_states)
        else:
            key, value = _token_rows(torch.cat((key_states, value_states), dim=-1)), None
        assert kernels.write is not None, "every step plans its writes"
        self.backend.write_kv(kernels.write, kv, key, value)
        plan.layers_written += 1
        return key_states, value_states

    @property
    def is_compileable(self) -> bool:
        return False

    # -- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        """Commit the written full pages, free every sequence, unbind from the model."""
        self._spent = True
        self.rows.close()
        model, self._model = self._model, None
        if model is not None:
            hf_binding.detach(model)

    def __enter__(self) -> KVCoreCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- each forward of the model (hf_binding.Forward) ---------------------------------

    def begin(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Plan this forward (at most one round trip); drop cached leading columns on the first."""
        if self._spent:
            raise BadRequest("this KVCoreCache is spent (closed, or a forward failed)")
        input_ids = args[0] if args else kwargs.get("input_ids")
        if input_ids is None:
            raise Unsupported("the kvcore cache needs input_ids (inputs_embeds carry no tokens)")
        mask = kwargs.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise Unsupported("the kvcore cache needs a 2D attention_mask tensor")
        if not self.rows.rows:
            skip, self._plan = self.rows.start(input_ids, mask)
            self.num_prompt_tokens = sum(len(r.tokens) for r in self.rows.rows)
            self.num_cached_tokens = sum(r.hit for r in self.rows.rows)
            for row in self.rows.rows:
                add_media(self.cached_tokens_by_source, media_in(row.sources, 0, row.hit))
            self.seen_columns = skip
            self._kernels = self._plan_kernels(self._plan)
            if skip:
                args, kwargs = _drop_columns(args, kwargs, skip)
            return args, kwargs
        _check_continues(self.rows, self.seen_columns, input_ids, kwargs)
        if mask is not None and not bool(mask[:, -input_ids.shape[1] :].all()):
            raise BadRequest("new tokens after the prompt must not be padding")
        self._plan = self.rows.step(input_ids.tolist())
        self._kernels = self._plan_kernels(self._plan)
        return args, kwargs

    def _plan_kernels(
        self, plan: StepPlan, attention: Attention | None = None
    ) -> DecodePlan | PrefillPlan:
        """The backend's plan of this forward (its one device sync): tables, lengths,
        slots and copy-on-write pairs, valid for every layer's cache. With
        ``attention`` (a layer's other options): the same tables, no writes."""
        kv = self._kv[0]
        io: dict[str, Any] = {}
        if attention is None:
            io = {"slots": plan.slots, "copies": plan.copies}
            attention = self._attention
        if plan.cu_seqlens_q is None:
            return self.backend.plan_decode(
                kv, plan.block_table, plan.seq_lens, attention=attention, **io
            )
        return self.backend.plan_prefill(
            kv, plan.block_table, plan.cu_seqlens_q, plan.seq_lens, attention=attention, **io
        )

    def _kernels_for(self, plan: StepPlan, attention: Attention) -> DecodePlan | PrefillPlan:
        """This forward's plan for a layer of ``attention``'s options."""
        assert self._kernels is not None
        if attention == self._attention:
            return self._kernels
        if attention not in self._variants:
            self._variants[attention] = self._plan_kernels(plan, attention)
        return self._variants[attention]

    def end(self, failed: bool) -> None:
        plan, self._plan, self._kernels = self._plan, None, None
        self._variants = {}
        if failed:
            self._spent = True
            self.rows.close()
            return
        assert plan is not None, "a forward ended that never began"
        if plan.layers_written != len(self._kv):
            self._spent = True
            self.rows.close()
            raise Unsupported(
                f"{plan.layers_written} of {len(self._kv)} layers called cache.update in one "
                "forward; the kvcore cache needs every layer to (no shared-KV or linear layers)"
            )
        self.rows.finish_step()
        self.seen_columns += plan.q

    # -- attention --------------------------------------------------------------------

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        scale: float,
        attention: Attention | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of query [B, Hq, q, D] over the pages: out [B, q, Hq, Dv] (Dv = D;
        on a latent pool: kv_lora_rank); ``attention``: the layer's options (None: the
        cache's own), ``sinks`` its [Hq] float32 sink logits."""
        plan, kernels = self._plan, self._kernels
        assert plan is not None and kernels is not None, "attend outside a planned forward"
        if attention is not None:
            kernels = self._kernels_for(plan, attention)
        kv = self._kv[layer_idx]
        batch, hq, q, dim = query.shape
        if plan.decode:
            assert isinstance(kernels, backends.DecodePlan)
            out: torch.Tensor = self.backend.decode(kernels, query[:, :, 0], kv, scale, sinks=sinks)
            return out.unsqueeze(1)
        assert isinstance(kernels, backends.PrefillPlan)
        flat = query.transpose(1, 2).reshape(batch * q, hq, dim)
        packed = flat if plan.q_index is None else flat.index_select(0, plan.q_index)
        out = self.backend.prefill(kernels, packed, kv, scale, sinks=sinks)
        if plan.q_index is not None:
            out = out.new_zeros((batch * q, *out.shape[1:])).index_copy_(0, plan.q_index, out)
        result: torch.Tensor = out.view(batch, q, hq, -1)
        return result


def _token_rows(states: torch.Tensor) -> torch.Tensor:
    """[B, H, q, D] per-head states as the kernels' token rows [B * q, H, D]."""
    batch, heads, q, dim = states.shape
    if q == 1:
        return states[:, :, 0]
    return states.transpose(1, 2).reshape(batch * q, heads, dim)


def _drop_columns(
    args: tuple[Any, ...], kwargs: dict[str, Any], skip: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Feed only columns [skip, L) of the per-token inputs (the attention mask keeps all)."""
    if args:
        args = (args[0][:, skip:], *args[1:])
    else:
        kwargs["input_ids"] = kwargs["input_ids"][:, skip:]
    for key in ("position_ids", "token_type_ids"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            kwargs[key] = value[..., skip:]
    return args, kwargs


def _check_continues(
    rows: PagedRows, seen: int, input_ids: torch.Tensor, kwargs: dict[str, Any]
) -> None:
    """BadRequest unless a later forward feeds the columns right after those the rows hold.

    A second generate call on the cache restarts its positions (its K/V would be
    computed at wrong positions and committed under the rows' tokens)."""
    q = input_ids.shape[-1]
    again = "a KVCoreCache serves one generate call (make a new one); this forward "
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] != seen + q:
        raise BadRequest(
            f"{again}has a {mask.shape[1]}-column attention mask; the cache holds {seen} "
            f"columns and {q} are fed"
        )
    cache_position = kwargs.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.numel():
        first = int(cache_position.reshape(-1)[0])
        if first != seen:
            raise BadRequest(f"{again}starts at cache position {first}, not {seen}")
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() in (1, 2) and positions.numel():
        firsts = positions.reshape(-1, positions.shape[-1])[:, 0].tolist()
        want = [len(row.tokens) for row in rows.rows]
        if len(firsts) == 1:
            firsts = firsts * len(want)
        if firsts != want:
            raise BadRequest(f"{again}starts at positions {firsts}, the rows hold {want} tokens")


def _check_layout(client: Client, model: torch.nn.Module, latent: tuple[int, int] | None) -> None:
    """LayoutMismatch unless the pool has the model's kind, layers, KV heads, head dim and
    dtype, or an fp8 dtype (``latent``: an MLA model's (kv_lora_rank, rope dim): one
    latent head)."""
    config: Any = model.config
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    want = {
        "kind": "kv" if latent is None else "latent",
        "num_layers": text.num_hidden_layers,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "dtype": client.layout.dtype if client.layout.dtype in FP8_DTYPES else model_dtype,
    }
    if latent is not None:
        want |= {"num_kv_heads": 1, "head_dim": sum(latent)}
    layout = client.layout.to_dict()
    wrong = {k: (v, layout[k]) for k, v in want.items() if layout[k] != v}
    if wrong:
        detail = ", ".join(f"{k}: model {m}, pool {p}" for k, (m, p) in wrong.items())
        flag = ",".join(f"{k}={v}" for k, v in want.items())
        raise LayoutMismatch(
            f"pool {client.pool!r} does not fit the model ({detail}); serve a pool with "
            f"--pool ...,{flag}"
        )
    device = next(model.parameters()).device
    if device != client.kv_caches[0].device:
        raise LayoutMismatch(f"the model is on {device}, the pool on {client.kv_caches[0].device}")
