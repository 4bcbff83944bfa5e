"""Build the model and load its weights from a local Hugging Face directory's ``*.safetensors`` files.

Every tensor name and shape is checked against the model before any weight is read, so a wrong or
incomplete checkpoint fails fast with the names at fault. Sharded checkpoints list their files in
``model.safetensors.index.json``; otherwise every ``*.safetensors`` file in the directory is read.
"""

import json
from pathlib import Path

import torch

from kvlab.engine.config import ModelConfig
from kvlab.engine.errors import WeightsError
from kvlab.extras import require
from kvlab.engine.layers import MergedLinear
from kvlab.engine.model import CausalLM

INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        files = [path / name for name in _shard_names(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index.name} lists shards that are not files in {path}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no *.safetensors weights (kvlab.engine reads safetensors only)")
    not_files = [f.name for f in files if not f.is_file()]
    if not_files:
        raise WeightsError(f"{path}: {not_files} are not files (a directory?); kvlab.engine reads *.safetensors "
                           "files")
    return files


def _shard_names(index: Path) -> list[str]:
    """The shard files a sharded checkpoint's index lists: plain file names in the model directory."""
    try:
        raw = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"cannot read the shard list {index}: {e}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else raw
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index} must hold a JSON object whose weight_map maps each tensor name to its shard's "
                           f"file name, got {type(weight_map).__name__} {str(weight_map)[:80]}")
    for name in weight_map.values():
        # A path would read a file outside the model directory.
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise WeightsError(f"{index}: weight_map values must be shard file names in the model directory, "
                               f"got {name!r}")
    return sorted(set(weight_map.values()))


def _skipped(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not load: rotary tables some exporters save, and
    the output matrix of a tied model (it is the embedding matrix)."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def _describe(names, limit=5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_checkpoint(files: list[Path], config: ModelConfig, expected: dict) -> dict:
    """Map each tensor the model needs to the file holding it, after checking names and shapes (metadata
    only, nothing is loaded). ``expected``: name -> shape."""
    # Imported here: safetensors is in the `engine` extra, and studies import the engine's scheduler without it.
    require(("safetensors",), "engine", "reading a model's weights")
    from safetensors import SafetensorError, safe_open

    where, unexpected, misshapen = {}, [], []
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if _skipped(name, config):
                        continue
                    if name in where:
                        raise WeightsError(f"tensor {name} is in both {where[name].name} and {file.name}")
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(expected[name]):
                        misshapen.append(f"{name}: {shape} in the file, {tuple(expected[name])} from config.json")
                    where[name] = file
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read {file}: {e}") from None
    missing = set(expected) - set(where)
    if missing:
        raise WeightsError(f"{config.path}: {len(missing)} weights missing: {_describe(missing)}")
    if unexpected:
        raise WeightsError(f"{config.path}: {len(unexpected)} tensors the {config.model_type} model does not have "
                           f"(another architecture?): {_describe(unexpected)}")
    if misshapen:
        raise WeightsError(f"{config.path}: {len(misshapen)} weights do not match config.json: "
                           + "; ".join(misshapen[:5]))
    return where


def checkpoint_layout(model: CausalLM) -> dict[str, tuple[str, slice]]:
    """Each checkpoint tensor's name -> the model parameter holding it and which of its rows: a merged
    projection (``MergedLinear``) holds its parts' tensors one after another, by output rows
    (``...self_attn.k_proj.weight`` -> ``("...self_attn.qkv_proj.weight", slice(q_size, q_size + kv_size))``);
    every other parameter is one tensor of the same name, whole."""
    merged = {name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)}
    layout = {}
    for name, _ in model.named_parameters(remove_duplicate=False):  # a tied output matrix has its own name
        module, _, kind = name.rpartition(".")  # kind: "weight" or "bias"
        if module not in merged:
            layout[name] = (name, slice(None))
            continue
        parent, start = module.rpartition(".")[0], 0
        for part, size in merged[module].parts.items():
            layout[f"{parent}.{part}.{kind}"] = (name, slice(start, start + size))
            start += size
    return layout


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model with its weights in ``dtype`` (fp32 for a module with ``FP32_PARAMETERS``) on ``device`` (built
    on the meta device first, so no memory is spent on random initial weights)."""
    with torch.device("meta"):
        model = CausalLM(config)
    params = dict(model.named_parameters())
    layout = checkpoint_layout(model)
    expected = {name: params[param][rows].shape for name, (param, rows) in layout.items()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]  # tied: the output matrix is the embedding, not read from the files
    where = check_checkpoint(weight_files(config.path), config, expected)
    # Parameters of modules that keep fp32 whatever the model's dtype (DeepSeek-V3's router: TopkRouter).
    fp32 = {f"{module_name}.{name}" for module_name, module in model.named_modules()
            if getattr(module, "FP32_PARAMETERS", False) for name, _ in module.named_parameters(recurse=False)}
    from safetensors import SafetensorError, safe_open  # the `engine` extra (see check_checkpoint)

    state = {}
    for file in sorted(set(where.values())):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in (n for n, w in where.items() if w == file):
                    state[name] = f.get_tensor(name).to(device=device,
                                                        dtype=torch.float32 if name in fp32 else dtype)
        except (SafetensorError, OSError) as e:  # e.g. truncated after its header was checked
            raise WeightsError(f"cannot read {file}: {e}") from None
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    merged = {}  # a merged parameter's parts, in layout order (which is its rows' order)
    for name, (param, _) in layout.items():
        merged.setdefault(param, []).append(state.pop(name))
    state = {param: parts[0] if len(parts) == 1 else torch.cat(parts) for param, parts in merged.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.requires_grad_(False).eval()
