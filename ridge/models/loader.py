"""Build a model from a spec: a Hugging Face directory, a GGUF file, or ``random:<preset>``.

A directory holds ``config.json`` and one or sharded ``*.safetensors`` files (with
``model.safetensors.index.json``). Files are memory-mapped (``safetensors_mmap``): a weight
in the model's dtype becomes its parameter with no copy; packed projections receive each
checkpoint shard in its row range. A ``.gguf`` file (``gguf_file``) carries its config and
tokenizer in its metadata; its quantized tensors load into layers of their own format.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.distributed.parallel import TensorParallel
from ridge.layers.linear import Linear
from ridge.models.gguf_file import GGUFModel, conversions, is_gguf, target_format
from ridge.models.gguf_file import layer_formats as gguf_layer_formats
from ridge.models.presets import get_preset
from ridge.models.registry import model_class
from ridge.models.safetensors_mmap import SafetensorsFile
from ridge.quantization.config import QuantizationConfig

RANDOM_PREFIX = "random:"

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # the registry's class for the architecture
    config: ModelConfig
    hf_config: dict
    model_dir: Path | None  # None for random models; a GGUF model's file
    max_model_len: int


def read_hf_config(spec: str) -> tuple[dict, Path | GGUFModel | None]:
    """The config dict of a spec, and its source: a directory, an opened GGUF file, or None
    for ``random:<preset>``."""
    if spec.startswith(RANDOM_PREFIX):
        return get_preset(spec[len(RANDOM_PREFIX) :]), None
    if is_gguf(spec):
        model = GGUFModel(spec)
        return model.hf_config, model
    model_dir = Path(spec).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"model directory {spec!r} does not exist (or pass random:<preset>)")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{spec!r} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(config_file.read_text()), model_dir
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None


def load_model(
    hf_config: dict,
    config: ModelConfig,
    model_dir: Path | GGUFModel | None,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    seed: int = 0,
    quantization: QuantizationConfig | None = None,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """Weights from ``model_dir``'s safetensors, or random ones (seeded) when it is None;
    linear layers in the format ``quantization`` gives each (quantized as they load). Under
    tensor parallelism (``tp``) the model holds this rank's slices: each checkpoint tensor is
    narrowed (a view of the mapped file) before it is copied, and a random model draws every
    weight whole and keeps its slice, so it is the same model at any parallel size."""
    context_limit = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    quantization = quantization or QuantizationConfig()
    tp = tp or TensorParallel()
    if isinstance(model_dir, GGUFModel):
        cls = model_class(config.architecture)
        quantization.file_formats = gguf_layer_formats(model_dir, cls.packed_modules, cls.stacking_for(config))
    model = _empty_model(config, context_limit, dtype, device, quantization, tp)
    if model_dir is None:
        _init_random(model, seed)
    elif isinstance(model_dir, GGUFModel):
        _load_gguf(model, model_dir)
    else:
        _load_safetensors(model, model_dir)
    if tp.enabled:
        _finish_split(model, tp)
    model.eval()
    source = model_dir.path if isinstance(model_dir, GGUFModel) else model_dir
    return LoadedModel(model, config, hf_config, source, context_limit)


def _finish_split(model: torch.nn.Module, tp: TensorParallel) -> None:
    """After loading a rank's slices: a row-parallel layer's bias counts once (rank 0's; the
    others' are zero, so the all-reduce adds it once), and a tied lm_head takes its rows of
    the embedding as loaded."""
    for module in model.modules():
        if isinstance(module, Linear) and module.tp_cols is not None and module.bias is not None and tp.rank:
            with torch.no_grad():
                module.bias.zero_()
    if model.config.tie_word_embeddings:
        model.tie_lm_head(split=True)


def _empty_model(
    config: ModelConfig,
    context_limit: int,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantizationConfig,
    tp: TensorParallel,
) -> torch.nn.Module:
    # Build on the meta device (no init cost), then allocate uninitialized storage once
    # (.to(dtype) converts floating tensors only: quantized blocks stay uint8).
    with torch.device("meta"):
        model = model_class(config.architecture)(config, context_limit, quant, tp)
    model = model.to(dtype).to_empty(device=device)
    model.materialize(device)
    return model


def _init_random(model: torch.nn.Module, seed: int) -> None:
    """Gaussian(0, 0.02) weights, norms at 1, drawn in place in the model's dtype on its device.

    Each parameter has its own generator (seeded from ``seed`` and the parameter's index), so
    the weights are reproducible for a seed on a given device type whatever the order, and on
    the CPU the parameters are filled by several threads at once (1.1B parameters: ~2.5 s on 2
    cores; drawing float32 and copying took 13 s).
    """
    params = list(model.named_parameters())
    device = params[0][1].device
    dtype = model.model.embed_tokens.weight.dtype
    modules = dict(model.named_modules())
    # A quantized layer has no Parameter: it draws its dense weight (as a Parameter would be
    # drawn, same generator) and loads it, quantizing. A split layer (tensor parallelism)
    # draws the whole weight and keeps its slice.
    quantized = [(f"{n}.weight", m) for n, m in model.named_modules() if isinstance(m, Linear) and m.method.format]
    draws: list[tuple[str, torch.Tensor | Linear]] = params + quantized
    for i, (name, _) in enumerate(draws):
        owner = modules.get(name.rsplit(".", 1)[0])
        if name.endswith(".weight") and isinstance(owner, Linear) and owner.full is not None:
            draws[i] = (name, owner)

    def fill(index: int) -> None:
        name, target = draws[index]
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            if isinstance(target, Linear):
                dense = torch.empty(*target.full_shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
                target.method.load_weight(target, target.local_part(dense, None), None)
            elif name.endswith("norm.weight"):
                target.fill_(1.0)
            else:
                target.normal_(0.0, 0.02, generator=gen)

    def size(i: int) -> int:
        target = draws[i][1]
        return target.full_shape[0] * target.full_shape[1] if isinstance(target, Linear) else target.numel()

    order = sorted(range(len(draws)), key=lambda i: -size(i))  # big ones first
    if device.type == "cpu":
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            list(pool.map(fill, order))
    else:
        for index in order:
            fill(index)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is corrupt: {exc}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{model_dir}: shards named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    return files


def _load_safetensors(model: torch.nn.Module, model_dir: Path) -> None:
    """Each file memory-mapped; a tensor in the parameter's dtype on the CPU becomes the
    parameter itself (a view of the page cache: no copy), others are copied in (a packed
    projection's shard into its rows, another dtype converted, another device uploaded)."""
    names = _loadable_names(model)
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    extra_layers: set[str] = set()
    for file in _weight_files(model_dir):
        handle = SafetensorsFile(file)
        for name in handle.keys():
            if "rotary_emb" in name:
                continue
            target = _target_of(name, names, model.packed_modules, model.expert_stacking)
            if target is None:
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                if _beyond_last_layer(name, model.config.num_layers):
                    extra_layers.add(name.split(".")[2])  # DeepSeek-V3's multi-token-prediction layer
                    continue
                raise ValueError(f"{file.name}: unexpected tensor {name!r} for {model.config.architecture}")
            load_tensor(model, modules, target, handle.get_tensor(name), name)
            loaded.add(target[0] if target[1] is None else f"{target[0]}#{target[1]}")
    _check_complete(model, loaded)
    if extra_layers:
        logger.info("skipped checkpoint layer(s) %s past num_hidden_layers (not used to decode)", sorted(extra_layers))


def _beyond_last_layer(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def _load_gguf(model: torch.nn.Module, gguf: GGUFModel) -> None:
    """Each tensor of the file into its parameter: blocks of a layer's own format as they are;
    anything else dequantized and handed to the layer's method."""
    names = _loadable_names(model)
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in gguf.tensors.items():
        target = _target_of(name, names, model.packed_modules, model.expert_stacking)
        if target is None:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            raise ValueError(f"{gguf.path.name}: unexpected tensor {name!r} for {model.config.architecture}")
        param_name, shard = target
        module = modules[param_name.rsplit(".", 1)[0]]
        fmt = module.method.shard_format(shard) if isinstance(module, Linear) else None
        # a split layer (tensor parallelism) reads only this rank's rows and columns of the map
        split = isinstance(module, Linear) and param_name.endswith(".weight") and module.full is not None
        tp_rows = module.tp_rows[shard or 0] if split and module.tp_rows is not None else None
        tp_cols = module.tp_cols if split else None
        if fmt is not None and param_name.endswith(".weight") and tensor.loads_as_blocks:
            if target_format(tensor.type_name) is fmt:
                rows = None if shard is None else module.shard_rows(shard)
                module.method.load_blocks(module, tensor.blocks(tp_rows, tp_cols), rows)
                loaded.add(param_name if shard is None else f"{param_name}#{shard}")
                continue
        if split:
            dense = tensor.dense(tp_rows, tp_cols)  # already this rank's part
            module.method.load_weight(module, dense, None if shard is None else module.shard_rows(shard))
            loaded.add(param_name if shard is None else f"{param_name}#{shard}")
            continue
        load_tensor(model, modules, target, tensor.dense(), name)
        loaded.add(param_name if shard is None else f"{param_name}#{shard}")
    _check_complete(model, loaded)
    for line in conversions(gguf, model.quant_config.file_formats, model.packed_modules, model.expert_stacking):
        logger.info("%s: %s", gguf.path.name, line)


def _loadable_names(model: torch.nn.Module) -> set[str]:
    """Every name a checkpoint tensor can land on: the parameters, and each linear layer's
    weight whatever form its method keeps it in."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return names | {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}


def load_tensor(model, modules: dict, target: tuple[str, int | None], tensor: torch.Tensor, name: str) -> None:
    """One checkpoint tensor into ridge's parameter ``target`` (name, packed shard or None): a
    linear layer's weight through its method, anything else into the parameter (the mapped
    file itself where dtype and device allow)."""
    param_name, shard = target
    module_name, leaf = param_name.rsplit(".", 1)
    module = modules[module_name]
    try:
        with torch.no_grad():
            if isinstance(module, Linear) and leaf == "weight":
                if tensor.dim() == 3:  # experts stored fused, (E, rows, K): the stacked layer's rows in order
                    tensor = tensor.flatten(0, 1)
                tensor = module.local_part(tensor, shard)  # this rank's slice (tensor parallelism)
                module.method.load_weight(module, tensor, None if shard is None else module.shard_rows(shard))
                return
            if isinstance(module, Linear) and leaf == "bias" and module.tp_rows is not None:
                tensor = module.tp_rows[shard or 0].of(tensor, 0)  # a column-parallel layer's bias is split too
            param = getattr(module, leaf)
            if shard is not None:
                _copy_checked(param[module.shard_rows(shard)], tensor, name)
            elif tensor.dtype == param.dtype and param.device.type == "cpu":
                _check_shape(param, tensor, name)
                param.data = tensor  # the mapped file itself
            else:
                _copy_checked(param, tensor, name)
    except ValueError as exc:
        if str(exc).startswith("weight "):
            raise ValueError(f"weight {name!r}{str(exc)[len('weight') :]}") from None
        raise


def _target_of(
    name: str,
    params: set[str],
    packed: dict[str, tuple[str, int]],
    stacking: dict[str, tuple[str, int, int]] | None = None,
) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (ridge parameter name, packed shard index or None).

    An expert's projection lands in its layer's stacked tensor:

        ...experts.{e}.{proj}.weight  ->  ...experts.{stacked}.weight, shard e * per_expert + index
    """
    candidates = [name] if name.startswith(("model.", "lm_head.")) else [name, f"model.{name}"]
    for cand in candidates:
        if cand in params:
            return cand, None
        parts = cand.split(".")
        if stacking and len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in stacking:
            stacked, index, per_expert = stacking[parts[-2]]
            stacked_param = ".".join(parts[:-3] + [stacked, parts[-1]])
            if stacked_param in params:
                return stacked_param, int(parts[-3]) * per_expert + index
        if len(parts) >= 2 and parts[-2] in packed:
            packed_name, shard = packed[parts[-2]]
            packed_param = ".".join(parts[:-2] + [packed_name, parts[-1]])
            if packed_param in params:
                return packed_param, shard
    return None


def _check_shape(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, the config expects {tuple(dst.shape)}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    _check_shape(dst, src, name)
    dst.copy_(src)


def _check_complete(model: torch.nn.Module, loaded: set[str]) -> None:
    missing = []
    modules = dict(model.named_modules())
    for name in sorted(_loadable_names(model)):
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module = modules[name.rsplit(".", 1)[0]]
        shards = len(getattr(module, "output_sizes", [])) or None
        # a packed layer's shards one by one, or all of it from one tensor (a GGUF file's stacked heads)
        wanted = [name] if shards is None or name in loaded else [f"{name}#{i}" for i in range(shards)]
        missing += [w for w in wanted if w not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
