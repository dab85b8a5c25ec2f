"""Which model computed a page: the ``model`` field of every engine's key space.

Two engines share a page only when they would compute the same K/V for its tokens.
Tokens and geometry alone do not say so: a base model and its fine-tune, or two
revisions, have one geometry and one tokenizer, and loading one's K/V into the
other gives wrong outputs with no error. So every engine derives a
:class:`ModelIdentity` from what it serves, with no operator action, and puts
:func:`space_model` of it (64 ASCII hex digits) in the ``model`` field of its key
space (spec/hashing.md), next to the namespace (tenants), LoRA adapter and salt.

What enters, and why:

* :class:`Source`, where the weights come from, derived by :func:`source_of` for
  every engine:

  - ``model``: the name or path the engine was given; a local path as its absolute
    real path, so a copy elsewhere is another model;
  - ``revision``: the revision asked for ("" for the default branch);
  - ``config``: :func:`config_digest` of the loaded config (an ``hf_overrides`` or
    ``--json-model-override-args`` changes it; runtime switches such as the
    attention implementation do not); "" where the engine has none;
  - ``weights``: what the engine knows of the weights it holds. An engine that
    loads a checkpoint (vLLM, SGLang) names it at no cost at any model size: a
    local file or directory is ``files:`` and a digest of every non-hidden file's
    (relative name, size, ``mtime_ns``) (:func:`path_weights`: a retrain or copy
    in place, even of equal bytes, is a miss; hashing a 100 GB checkpoint at each
    start would not be cheap); a hub name is the snapshot commit it resolves to
    offline (``hub:<commit>``: content-addressed). A transformers model is a
    module the program may have built, trained, merged or fitted with adapters
    in memory, so it is always its tensors (:func:`tensor_weights`). Weights an
    engine made up (vLLM's and SGLang's ``--load-format dummy``) are
    :func:`process_nonce`: shared with no other process, even under a
    ``model_id``. What the engine cannot name is each engine's rule: vLLM keeps
    ``weights`` "" (name, revision, config and code revision stand for them) and
    warns; SGLang takes the process nonce and warns;
  - ``code_revision``: the revision of remote modelling code (vLLM's
    ``code_revision``); "" for none.

  An operator's ``model_id`` replaces all of it (``Source(model_id=...)``): a
  declaration that deployments are the same model (the same weights at two
  paths). It is the only way two different sources share pages.
* ``dtype`` (the model computes in), ``kv_dtype`` (the cache stores in: "auto"
  resolved by :func:`kv_dtype_of`), ``kv_scales`` and ``quantization``: they
  change K/V for the same weights, and enter even under a ``model_id``.
* ``kv_scales``: where the scales of a quantized KV cache (fp8: each layer's
  ``k_scale`` / ``v_scale``; the cache holds K/scale, V/scale) come from, for
  pages written under one scale are garbage read under another. "" for a float
  cache (no scales: the identity of every float engine is unchanged).
  :data:`CHECKPOINT_SCALES` ("checkpoint") where they are a function of the
  source: read from the checkpoint, or the engine's default 1.0 where it holds
  none; the source (weights' files, or an operator's ``model_id``, which
  declares the checkpoints the same) covers them, so they are not digested.
  :func:`process_nonce` where the engine computes them per instance from the
  first batches it runs (an older vLLM's ``calculate_kv_scales``; vLLM 0.32 has
  no such setting): two instances get other scales, so such an engine shares
  with no other process, and says so once in a warning naming the setting.
* The shard, where a page's bytes depend on it: ``tp_size`` and ``pp_size``, and
  ``tp_rank`` and ``pp_rank`` where the pool's layout does not separate ranks
  already. A vLLM pool page holds every KV head of the model, each TP rank copying
  its own (kvcore/integrations/vllm/ranks.py): a head's K/V are the model's on
  whichever rank computes them (TP changes float rounding only, as a batch size
  does), so vLLM's identity names no TP size (the default 1: a TP=2 engine shares
  with a TP=1 one), and its ranks are ``None``; ``pp_size`` still enters (a stage's
  shard holds its layers). Each SGLang rank is a client of its own on a pool of its
  own heads, so its ``tp_size`` and rank enter: those bytes differ by TP size.
* ``kv_format``: the byte format the engine's kernels write K/V in, where it is not
  kvcore's page order element by element (spec/hashing.md, "Byte formats"): an
  engine whose pages hold packed or permuted K/V names its writer, so that no
  engine of another format reads them. "" for the plain format (the transformers
  Cache and SGLang write K/V as the pool's layout says); vLLM's connector names
  its attention backend and, for its CPU backend, the ISA path
  (:func:`kvcore.integrations.vllm.backends.kv_format`).
* ``kv_dtype`` spells each format once: vLLM's "fp8" is "fp8_e4m3"
  (:data:`KV_DTYPE_ALIASES`), so engines that name one format two ways share.

Equal inputs give equal strings in every process (msgpack of frozen structs, no
built-in ``hash``), except a process nonce. Append fields only at the end, each
with a default that is omitted from the encoding: the encoding is the key space,
and identities that do not set a new field keep their strings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvcore.errors import Unsupported

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKPOINT_SCALES",
    "ModelIdentity",
    "Source",
    "adapter_state",
    "config_digest",
    "declared",
    "hub_weights",
    "kv_dtype_of",
    "kv_scales_of",
    "local_path",
    "path_weights",
    "process_nonce",
    "source_of",
    "space_model",
    "tensor_weights",
    "transformers_identity",
    "transformers_model",
    "vllm_identity",
    "vllm_model",
]

log = logging.getLogger(__name__)

DOMAIN = b"kvcore/model/v1"
CHECKPOINT_SCALES = "checkpoint"  # kv_scales: the source's (module docstring)
FLOAT_CACHE_DTYPES = frozenset({"auto", "float", "half", "float16", "bfloat16", "float32"})
DUMMY = "dummy"  # the load format of random weights (vLLM's and SGLang's --load-format)
# Config keys that are runtime switches or bookkeeping, not the model, at any depth.
_VOLATILE = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "attn_implementation",
        "_experts_implementation_internal",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
_TOP_VOLATILE = frozenset({"dtype", "torch_dtype"})  # the model's actual dtype is a field
_NONCE = "nonce:" + secrets.token_hex(16)  # this process's (process_nonce)
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
"""Cache dtypes spelled two ways: vLLM's (and SGLang's) "fp8" is OCP e4m3 wherever
kvcore maps the cache (kvcore/integrations/vllm/pages.py refuses ROCm's fnuz)."""


class Source(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a model's weights come from (module docstring); either the derived
    fields (:func:`source_of`) or ``model_id`` alone (an operator's declaration),
    never both."""

    model: str = ""
    revision: str = ""
    config: str = ""
    weights: str = ""
    model_id: str = ""
    code_revision: str = ""

    def __post_init__(self) -> None:
        derived = (self.model, self.revision, self.config, self.weights, self.code_revision)
        if self.model_id and any(derived):
            raise ValueError("a model_id replaces the derived source; give one or the other")


class ModelIdentity(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What determines the K/V an engine computes for given tokens (module docstring).
    Append fields only at the end, with defaults: the encoding is the key space."""

    source: Source
    dtype: str  # the dtype the model computes in ("bfloat16"); "" if the engine does not say
    kv_dtype: str  # the dtype the KV cache stores ("fp8_e4m3"); "" if the engine does not say
    kv_scales: str = ""  # where a quantized cache's scales come from (module docstring)
    quantization: str = ""  # the quantization method ("fp8", "awq"); "" for none
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int | None = None  # None: the pool's shards separate the ranks
    pp_rank: int | None = None
    kv_format: str = ""  # the writer's byte format; "" plain (module docstring)


def space_model(identity: ModelIdentity) -> str:
    """The key space's ``model`` string of ``identity``: 64 lowercase hex digits."""
    return hashlib.sha256(DOMAIN + msgspec.msgpack.encode(identity)).hexdigest()


def declared(model_id: str) -> Source:
    """The source an operator's ``model_id`` declares."""
    return Source(model_id=model_id)


def source_of(
    name_or_path: str,
    *,
    revision: str = "",
    config: Any = None,
    code_revision: str = "",
    weights: str | None = None,
    cache_dir: str | None = None,
) -> Source:
    """The derived source of the model an engine was given as ``name_or_path`` (every
    engine's one derivation; module docstring). ``config``: the engine's loaded
    config object (None: none). ``weights``: what the engine knows of its weights
    itself (tensors, a process nonce); None derives them from ``name_or_path``: a
    local path is :func:`path_weights`, a hub name the commit its config was loaded
    from or the one it resolves to in the local hub cache (``cache_dir``), "" when
    neither is known."""
    local = local_path(name_or_path)
    if weights is None:
        if local is not None:
            weights = path_weights(local)
        elif name_or_path:
            weights = _commit_of(config) or hub_weights(name_or_path, revision, cache_dir)
        else:
            weights = ""
    return Source(
        model=local or name_or_path,
        revision=revision,
        config="" if config is None else config_digest(config),
        weights=weights,
        code_revision=code_revision,
    )


def kv_dtype_of(cache_dtype: str, dtype: str) -> str:
    """The dtype a KV cache stores: an engine's ``"auto"`` cache dtype is the model's
    ``dtype``; any other (``"fp8_e4m3"``, "" for unknown) is itself, spelled one way
    (:data:`KV_DTYPE_ALIASES`)."""
    return dtype if cache_dtype == "auto" else KV_DTYPE_ALIASES.get(cache_dtype, cache_dtype)


def kv_scales_of(cache_dtype: str, *, computed: bool = False, setting: str = "") -> str:
    """``kv_scales`` of an engine's cache: "" for a float ``cache_dtype``;
    :data:`CHECKPOINT_SCALES` for a quantized one whose scales the checkpoint gives
    (or the engine's default); :func:`process_nonce` if the engine ``computed`` them
    itself, with a warning naming its ``setting``."""
    if cache_dtype in FLOAT_CACHE_DTYPES or not cache_dtype:
        return ""
    if not computed:
        return CHECKPOINT_SCALES
    log.warning(
        "kvcore: %s computes the %s KV cache scales in this instance; its pages are "
        "shared with no other process (scales from the checkpoint are)",
        setting,
        cache_dtype,
    )
    return process_nonce()


def process_nonce() -> str:
    """``nonce:`` and 32 random hex digits, drawn once per process: the weights of a
    model no other process may share pages with (random weights, or weights nothing
    names)."""
    return _NONCE


# -- the parts of a source ------------------------------------------------------------


def config_digest(config: Any) -> str:
    """Hex SHA-256 of a transformers config as canonical JSON, without :data:`_VOLATILE`
    keys (at any depth) and its top-level dtype. A value JSON does not know is taken
    by ``str`` (an address in it would only make a miss)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    data = {k: v for k, v in _pruned(data).items() if k not in _TOP_VOLATILE}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _pruned(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _pruned(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, (list, tuple)):
        return [_pruned(v) for v in value]
    return value


def path_weights(path: str | os.PathLike[str]) -> str:
    """``files:`` and a hex SHA-256 of (relative POSIX name, size, ``mtime_ns``) of every
    regular file at ``path`` (a file, or a directory walked in name order; names with a
    hidden component, such as ``.git`` or ``.cache``, are skipped); a symlinked file
    is its target, as loaders read it (a hub snapshot's files link into its blobs)."""
    root = Path(path)
    if root.is_file():
        files = [(root.name, root.stat())]
    else:
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if not name.startswith("."):
                    full = Path(dirpath, name)
                    files.append((full.relative_to(root).as_posix(), full.stat()))
    entries = sorted((name, st.st_size, st.st_mtime_ns) for name, st in files)
    return "files:" + hashlib.sha256(msgspec.msgpack.encode(entries)).hexdigest()


def hub_weights(repo_id: str, revision: str = "", cache_dir: str | None = None) -> str:
    """``hub:<commit>`` of the snapshot ``repo_id`` at ``revision`` resolves to in the
    local Hugging Face cache (no network), "" if that is unknown."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            repo_id, "config.json", cache_dir=cache_dir, revision=revision or None
        )
    except (ImportError, ValueError):  # no huggingface_hub; not a repo id
        return ""
    return f"hub:{Path(found).parent.name}" if isinstance(found, str) else ""


def tensor_weights(module: torch.nn.Module) -> str:
    """``tensors:`` and a hex SHA-256 of ``module``'s state dict (its parameters and
    persistent buffers: each entry's name, dtype, shape and bytes, in order), then of
    :func:`adapter_state` when PEFT adapters are loaded (their tensors are in the
    state dict already; which of them apply, and how, is not).

    Computed afresh at every call: a write through ``.data`` changes the bytes
    without telling torch (no version counter moves), so nothing cheaper is sound.
    That is one pass over the weights (SHA-256 runs at 0.5 to 2 GB/s on one core);
    a KVCoreCache makes it once, when it is built, and not under a ``model_id``.
    Unsupported for weights that are not in memory (the meta device: offloaded)."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor.is_meta:
            raise Unsupported(
                f"{name} is not in memory (offloaded), so the model's weights cannot be "
                f"digested; pass model_id to name them"
            )
        flat = tensor.detach().reshape(-1).cpu().contiguous()
        header = [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
        digest.update(msgspec.msgpack.encode(header))
        digest.update(flat.view(torch.uint8).numpy())
    digest.update(adapter_state(module).encode())
    return "tensors:" + digest.hexdigest()


def adapter_state(module: torch.nn.Module) -> str:
    """The canonical JSON of the PEFT adapters loaded into ``module`` (by PEFT or
    transformers' ``load_adapter``), "" when there are none: the module's
    ``peft_config`` and, per PEFT tuner layer in module order, its name, active and
    merged adapters, whether adapters are disabled, and its scaling."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:  # PEFT never imported: nothing has loaded an adapter
        return ""
    tuner_layer: type = tuners.BaseTunerLayer
    layers = [
        _tuner_state(name, layer)
        for name, layer in module.named_modules()
        if isinstance(layer, tuner_layer)
    ]
    configs = getattr(module, "peft_config", None)
    if not layers and not configs:
        return ""
    config = {
        str(k): v.to_dict() if hasattr(v, "to_dict") else v for k, v in (configs or {}).items()
    }
    data = {"peft_config": config, "layers": layers}
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def _tuner_state(name: str, layer: Any) -> list[Any]:
    """What decides a PEFT tuner layer's output besides its tensors."""
    return [
        name,
        sorted(layer.active_adapters),
        list(layer.merged_adapters),
        bool(layer.disable_adapters),
        dict(getattr(layer, "scaling", {})),
    ]


def local_path(path: str) -> str | None:
    """The absolute real path of ``path`` if it names a local file or directory."""
    return os.path.realpath(path) if path and os.path.exists(path) else None


# -- engines --------------------------------------------------------------------------


def vllm_model(vllm_config: Any, model_id: str = "") -> str:
    """The ``model`` string of a vLLM engine, from its ``VllmConfig`` (vLLM 0.32):
    ``model_config`` (``model``, ``revision``, ``code_revision``, ``hf_config``,
    ``dtype``, ``quantization``), ``load_config`` (``load_format``,
    ``download_dir``), ``cache_config.cache_dtype`` (and ``calculate_kv_scales``,
    where a vLLM has it: :func:`kv_scales_of`), ``parallel_config``'s PP size (not
    its TP size: module docstring), and the byte format its attention backend writes
    (``kv_format``). Equal on every rank (the sharded pool separates them)."""
    return space_model(vllm_identity(vllm_config, model_id))


def vllm_identity(vllm_config: Any, model_id: str = "") -> ModelIdentity:
    """The identity :func:`vllm_model` hashes. ``--load-format dummy`` (random weights)
    is :func:`process_nonce`, even under a ``model_id``; weights nothing names (a hub
    name with no cached commit) are "", with a warning that recommends ``model_id``."""
    mc, parallel = vllm_config.model_config, vllm_config.parallel_config
    load = getattr(vllm_config, "load_config", None)
    name = str(mc.model)
    dummy = _name(getattr(load, "load_format", "")) == DUMMY
    if model_id and not dummy:
        source = declared(model_id)
    else:
        if dummy and model_id:
            log.warning("kvcore: %s: random weights (load format dummy); model_id ignored", name)
        source = source_of(
            name,
            revision=str(mc.revision or ""),
            config=mc.hf_config,
            code_revision=str(getattr(mc, "code_revision", None) or ""),
            weights=process_nonce() if dummy else None,
            cache_dir=getattr(load, "download_dir", None),
        )
        if not source.weights:
            log.warning(
                "kvcore: cannot identify the weights of %s (no local path, no hub commit in "
                "the local cache); its pages are keyed by name, revision and config only. "
                "Set model_id in kv_connector_extra_config to declare which model it is",
                name,
            )
    from kvcore.integrations.vllm.backends import kv_format

    dtype = _name(mc.dtype)
    cache = vllm_config.cache_config
    computed = bool(getattr(cache, "calculate_kv_scales", False))  # not in vLLM 0.32
    return ModelIdentity(
        source=source,
        dtype=dtype,
        kv_dtype=kv_dtype_of(str(cache.cache_dtype), dtype),
        kv_scales=kv_scales_of(
            str(cache.cache_dtype), computed=computed, setting="calculate_kv_scales"
        ),
        quantization=str(mc.quantization or ""),
        pp_size=int(parallel.pipeline_parallel_size),  # no tp_size: a page has every head
        kv_format=kv_format(vllm_config),
    )


def transformers_model(model: torch.nn.Module, model_id: str = "") -> str:
    """The ``model`` string of a transformers model (``model.config``, its
    ``name_or_path``, dtype and tensors). Unsupported for a tensor-parallel model."""
    return space_model(transformers_identity(model, model_id))


def transformers_identity(model: torch.nn.Module, model_id: str = "") -> ModelIdentity:
    """The identity :func:`transformers_model` hashes: its ``name_or_path`` and config,
    and always its tensors (:func:`tensor_weights`, adapters included): a config's
    name or commit does not say what weights the module holds now (``from_config``,
    training, merges, adapters)."""
    config: Any = model.config
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size > 1:
        raise Unsupported(
            f"the kvcore cache holds unsharded models; this one is tensor-parallel "
            f"(tp_size {tp_size})"
        )
    if model_id:
        source = declared(model_id)
    else:
        name = str(getattr(config, "name_or_path", "") or "")
        source = source_of(name, config=config, weights=tensor_weights(model))
    dtype = _name(next(model.parameters()).dtype)
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    method = method or getattr(quant, "quant_method", None)
    return ModelIdentity(
        source=source,
        dtype=dtype,
        kv_dtype=dtype,  # the cache stores what the attention layers hand it
        quantization=_name(method or ""),
    )


def _commit_of(config: Any) -> str:
    commit = getattr(config, "_commit_hash", None)
    return f"hub:{commit}" if commit else ""


def _name(value: Any) -> str:
    """An engine's enum, torch dtype or string as its plain name ("bfloat16", "dummy")."""
    return str(getattr(value, "value", value)).removeprefix("torch.")
