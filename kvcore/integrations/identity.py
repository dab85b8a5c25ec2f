"""Which model computed a page: the ``model`` field of every engine's key space.

Two engines share a page only when they would compute the same K/V for its tokens.
Tokens and geometry alone do not say so: a base model and its fine-tune, or two
revisions, have one geometry and one tokenizer, and loading one's K/V into the
other gives wrong outputs with no error. So every engine derives a
:class:`ModelIdentity` from what it serves, with no operator action, and puts
:func:`space_model` of it (64 ASCII hex digits) in the ``model`` field of its key
space (spec/hashing.md), next to the namespace (tenants), LoRA adapter and salt.

What enters, and why:

* :class:`Source`, where the weights come from:

  - ``model``: the name or path the engine was given; a local path as its absolute
    real path, so a copy elsewhere is another model;
  - ``revision``: the revision asked for ("" for the default branch);
  - ``config``: :func:`config_digest` of the loaded config (an ``hf_overrides``
    changes it; runtime switches such as the attention implementation do not);
  - ``weights``, chosen to cost nothing at any model size and to miss when in
    doubt: for a local file or directory, ``files:`` and a digest of every
    non-hidden file's (relative name, size, ``mtime_ns``) (:func:`path_weights`:
    a retrain or copy in place, even of equal bytes, is a miss; hashing the bytes
    of a 100 GB checkpoint at each start would not be cheap); for a hub name, the
    snapshot commit it resolves to offline (``hub:<commit>``: content-addressed),
    "" when that is unknown (then name, revision and config stand for it); for a
    model object with no path or hub commit (built in memory, as kvcore's demo and
    tests do), ``tensors:`` and a digest of its state dict's bytes
    (:func:`tensor_weights`, recomputed when a tensor changes in place).

  An operator's ``model_id`` replaces all of it (``Source(model_id=...)``): a
  declaration that deployments are the same model (the same weights at two
  paths). It is the only way two different sources share pages.
* ``dtype`` (the model computes in), ``kv_dtype`` (the cache stores in; "auto"
  resolved), ``kv_scales`` (a digest of fp8 KV scales; "" until kvcore stores
  fp8) and ``quantization``: they change K/V for the same weights, and enter
  even under a ``model_id``.
* The shard: ``tp_size`` and ``pp_size`` always; ``tp_rank`` and ``pp_rank`` where
  the pool's layout does not separate ranks already. In vLLM every TP rank writes
  its own shard of one sharded pool under one key, so its ranks are ``None``; each
  SGLang rank is a client of its own on an unsharded pool, so its rank enters.

Equal inputs give equal strings in every process (msgpack of frozen structs, no
built-in ``hash``). Append fields only at the end, each with a default that is
omitted from the encoding: the encoding is the key space, and identities that do
not set a new field keep their strings.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvcore.errors import Unsupported

if TYPE_CHECKING:
    import torch

__all__ = [
    "ModelIdentity",
    "Source",
    "config_digest",
    "declared",
    "hub_weights",
    "local_path",
    "path_weights",
    "space_model",
    "tensor_weights",
    "transformers_identity",
    "transformers_model",
    "vllm_identity",
    "vllm_model",
]

DOMAIN = b"kvcore/model/v1"
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


class Source(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a model's weights come from (module docstring); either the four derived
    fields or ``model_id`` alone (an operator's declaration), never both."""

    model: str = ""
    revision: str = ""
    config: str = ""
    weights: str = ""
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.model_id and (self.model or self.revision or self.config or self.weights):
            raise ValueError("a model_id replaces the derived source; give one or the other")


class ModelIdentity(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What determines the K/V an engine computes for given tokens (module docstring).
    Append fields only at the end, with defaults: the encoding is the key space."""

    source: Source
    dtype: str  # the dtype the model computes in ("bfloat16"); "" if the engine does not say
    kv_dtype: str  # the dtype the KV cache stores ("fp8_e4m3"); "" if the engine does not say
    kv_scales: str = ""  # digest of the fp8 KV scales, when they exist
    quantization: str = ""  # the quantization method ("fp8", "awq"); "" for none
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int | None = None  # None: the pool's shards separate the ranks
    pp_rank: int | None = None


def space_model(identity: ModelIdentity) -> str:
    """The key space's ``model`` string of ``identity``: 64 lowercase hex digits."""
    return hashlib.sha256(DOMAIN + msgspec.msgpack.encode(identity)).hexdigest()


def declared(model_id: str) -> Source:
    """The source an operator's ``model_id`` declares."""
    return Source(model_id=model_id)


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


_TENSOR_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[tuple[tuple[int, int], ...], str]] = (
    weakref.WeakKeyDictionary()
)


def tensor_weights(module: torch.nn.Module) -> str:
    """``tensors:`` and a hex SHA-256 of ``module``'s state dict: each entry's name,
    dtype, shape and bytes, in order. Kept per module while no tensor is replaced or
    changed in place (torch's version counters), so a second call costs no hashing."""
    import torch

    state = module.state_dict(keep_vars=True)
    versions = tuple((t.data_ptr(), t._version) for t in state.values())
    cached = _TENSOR_DIGESTS.get(module)
    if cached is not None and cached[0] == versions:
        return cached[1]
    digest = hashlib.sha256()
    for name, tensor in state.items():
        flat = tensor.detach().reshape(-1).cpu().contiguous()
        header = [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
        digest.update(msgspec.msgpack.encode(header))
        digest.update(flat.view(torch.uint8).numpy())
    weights = "tensors:" + digest.hexdigest()
    _TENSOR_DIGESTS[module] = (versions, weights)
    return weights


def local_path(path: str) -> str | None:
    """The absolute real path of ``path`` if it names a local file or directory."""
    return os.path.realpath(path) if path and os.path.exists(path) else None


# -- engines --------------------------------------------------------------------------


def vllm_model(vllm_config: Any, model_id: str = "") -> str:
    """The ``model`` string of a vLLM engine, from its ``VllmConfig`` (vLLM 0.32):
    ``model_config`` (``model``, ``revision``, ``hf_config``, ``dtype``,
    ``quantization``), ``cache_config.cache_dtype`` and ``parallel_config``'s TP and PP
    sizes. Equal on every rank (the sharded pool separates them)."""
    return space_model(vllm_identity(vllm_config, model_id))


def vllm_identity(vllm_config: Any, model_id: str = "") -> ModelIdentity:
    """The identity :func:`vllm_model` hashes."""
    mc, parallel = vllm_config.model_config, vllm_config.parallel_config
    if model_id:
        source = declared(model_id)
    else:
        name, revision = str(mc.model), str(mc.revision or "")
        local = local_path(name)
        if local is not None:
            weights = path_weights(local)
        else:
            load = getattr(vllm_config, "load_config", None)
            weights = _commit_of(mc.hf_config) or hub_weights(
                name, revision, getattr(load, "download_dir", None)
            )
        source = Source(
            model=local or name,
            revision=revision,
            config=config_digest(mc.hf_config),
            weights=weights,
        )
    dtype = _dtype_name(mc.dtype)
    kv = str(vllm_config.cache_config.cache_dtype)
    return ModelIdentity(
        source=source,
        dtype=dtype,
        kv_dtype=dtype if kv == "auto" else kv,
        quantization=str(mc.quantization or ""),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
    )


def transformers_model(model: torch.nn.Module, model_id: str = "") -> str:
    """The ``model`` string of a transformers model (``model.config``, its
    ``name_or_path``, dtype and state dict). Unsupported for a tensor-parallel model."""
    return space_model(transformers_identity(model, model_id))


def transformers_identity(model: torch.nn.Module, model_id: str = "") -> ModelIdentity:
    """The identity :func:`transformers_model` hashes: a local ``name_or_path`` is its
    files, a hub name its commit, anything else (a model built in memory) its tensors."""
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
        local = local_path(name)
        if local is not None:
            weights = path_weights(local)
        else:
            weights = (_commit_of(config) or (hub_weights(name) if name else "")) or (
                tensor_weights(model)
            )
        source = Source(model=local or name, config=config_digest(config), weights=weights)
    dtype = _dtype_name(next(model.parameters()).dtype)
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    method = method or getattr(quant, "quant_method", None)
    return ModelIdentity(
        source=source,
        dtype=dtype,
        kv_dtype=dtype,  # the cache stores what the attention layers hand it
        quantization=str(getattr(method, "value", method) or ""),
    )


def _commit_of(config: Any) -> str:
    commit = getattr(config, "_commit_hash", None)
    return f"hub:{commit}" if commit else ""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
