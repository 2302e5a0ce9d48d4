"""What vLLM needs on a lent GPU machine (Python 3.12, torch 2.11.0+cu130, no vLLM, no internet) that its image
lacks, downloaded here: benchmarks/gpu/vllm.sh's `prepare` (benchmarks/gpu/pieces.py then cuts it into pieces).

    python benchmarks/gpu/wheels.py plan VLLM_WHEEL     # vLLM's Requires-Dist: carried / the image has it / left out
    python benchmarks/gpu/wheels.py fetch VERSION DL    # vLLM's wheel + what it needs + arctic-inference's sdist -> DL
    python benchmarks/gpu/wheels.py check DL            # every wheel fits CPython 3.12 manylinux x86_64 (by its tags)

`fetch` resolves with pip's own resolver (metadata only) for CPython 3.12 on manylinux x86_64, the image's torch stack
stood in for by empty local wheels, then downloads with --no-deps only what is neither the image's torch stack nor in
the image's package list (KINDS.md) nor one of the GPU kernel libraries left out below, one version of each. It
writes DL/carried.txt (what is carried, left out and why) and DL/vllm_torch_symbols.txt (the torch C symbols vLLM's
compiled ops import, looked up in the image's libtorch by `install`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


# vLLM's Requires-Dist that the device must not take from us: the image's torch stack (torch 2.11.0+cu130,
# torchvision 0.26, torchaudio 2.11, triton 3.6, CUDA 13's nvidia-* and cuda-* libraries): a wheel of ours would
# replace them, and vLLM's pins (torch==2.14.0 for 0.33.0) would not match the image's CUDA build.
TORCH_STACK = {"torch", "torchvision", "torchaudio", "triton"}
TORCH_PREFIXES = ("nvidia-", "cuda-")
# GPU kernel libraries vLLM imports only on the paths that use them (FlashInfer attention/sampling, CuTe-DSL and
# TileLang kernels, MLA, MoE, video decode, alternative weight loaders): built against torch 2.14 or large, and not
# on the path of a dense Llama with vLLM's own FlashAttention backend. `install` names any that an import misses.
LEFT_OUT = {
    "flashinfer-python": "FlashInfer attention/sampler kernels (JIT, needs its cubins); vLLM falls back to FlashAttention",
    "apache-tvm-ffi": "FlashInfer's and TileLang's FFI",
    "tilelang": "TileLang kernels (MLA/MoE paths)",
    "nvidia-cudnn-frontend": "cuDNN frontend (MLA prefill on Blackwell)",
    "nvidia-cutlass-dsl": "CuTe DSL (about 100 MB; quack/FlashInfer kernels)",
    "quack-kernels": "CuTe-DSL kernels (RMSNorm/MoE alternatives)",
    "tokenspeed-mla": "MLA decode kernels (DeepSeek-style models)",
    "humming-kernels": "quantised GEMM kernels",
    "pynvvideocodec": "video decode for multimodal inputs",
    "torchcodec": "audio/video decode, built against a newer torch",
    "fastsafetensors": "optional GPU-direct weight loader",
    "instanttensor": "optional weight loader",
    "numba": "pinned ==0.65.0; the image has numba (and its llvmlite) built for its numpy: keep the image's",
}
# tailrl's own needs that the image lacks (pyproject's dependencies minus the image's list; ray stays out: only
# rollout.workers > 1 uses it, and its wheel is about 70 MB)
TAILRL_EXTRA = ["gguf", "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime"]
# The packages the lent machines' image 'cuda' holds (/work/.library/device/KINDS.md, read 2026-11-17)
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
# versions the image was seen with (KINDS.md's pip list), for the resolver's constraints
IMAGE_PINS = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0",
              "transformers": "5.17.0", "tokenizers": "0.23.2", "huggingface-hub": "1.33.0", "safetensors": "0.8.0",
              "numpy": "2.5.2", "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "accelerate": "1.15.0"}


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# ---------------------------------------------------------------- plan (here only)

def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def plan(requires: list[str]) -> dict[str, list[tuple[str, str]]]:
    """vLLM's requirements for CPython 3.12 on Linux x86_64 (no extras) in three lists of (requirement, why):
    carry (resolve and download), image (the image has the package), out (torch stack or left out)."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "extra": ""}
    groups: dict[str, list[tuple[str, str]]] = {"carry": [], "image": [], "out": []}
    for line in requires:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        name = norm(r.name)
        spec = f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{r.specifier}"
        if name in TORCH_STACK or name.startswith(TORCH_PREFIXES) and name not in LEFT_OUT:
            groups["out"].append((spec, "the image's torch stack (must match its torch 2.11.0+cu130)"))
        elif name in LEFT_OUT:
            groups["out"].append((spec, LEFT_OUT[name]))
        elif name in IMAGE:
            groups["image"].append((spec, "in the image"))
        else:
            groups["carry"].append((spec, "missing from the image"))
    return groups


PLATFORMS = ["manylinux_2_%d_x86_64" % n for n in (39, 35, 34, 31, 28, 27, 26, 24, 17, 5)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
          *[a for p in PLATFORMS for a in ("--platform", p)]]
ARCTIC = "arctic-inference==0.3.0"  # suffix's tree: an sdist only; built on the device (16 cores) if asked
NANOBIND = "nanobind==2.9.2"        # arctic-inference's build pins it; only the build sees it


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def resolve(specs: list[str], work: Path) -> list[str]:
    """name==version for the packages that SPECS need on the device, found by pip's resolver for CPython 3.12
    on manylinux x86_64 (metadata only), with the image's torch stack stood in for by empty local wheels (so
    nothing pulls another torch) and then left out, as is every package the image holds."""
    stubs = work / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    cons = []
    for name, ver in {k: IMAGE_PINS[k] for k in ("torch", "torchvision", "torchaudio", "triton")}.items():
        v, di = ver + "+image", f"{name}-{ver}+image.dist-info"
        with zipfile.ZipFile(stubs / f"{name}-{v}-py3-none-any.whl", "w") as z:
            z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
            z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            z.writestr(f"{di}/RECORD", "")
        cons.append(f"{name}=={v}")
    cons += [f"{k}=={v}" for k, v in IMAGE_PINS.items() if k not in ("torch", "torchvision", "torchaudio", "triton",
                                                                     "numpy")]  # mistral_common wants numpy<2.4
    (work / "constraints.txt").write_text("\n".join(cons) + "\n")
    (work / "requirements.txt").write_text("\n".join(specs) + "\n")
    report = work / "report.json"
    pip("install", "-q", "--dry-run", "--ignore-installed", "--target", str(work / "none"), *TARGET,
        "--find-links", str(stubs), "-c", str(work / "constraints.txt"), "-r", str(work / "requirements.txt"),
        "--report", str(report))
    pins = []
    for item in json.loads(report.read_text())["install"]:
        name, ver = norm(item["metadata"]["name"]), item["metadata"]["version"]
        if name in IMAGE or name in TORCH_STACK or name.startswith(TORCH_PREFIXES) and name not in LEFT_OUT:
            continue
        pins.append(f"{name}=={ver}")
    return sorted(pins)


def torch_symbols(wheel: Path, out: Path) -> int:
    """The torch C symbols (aoti_torch_*, torch_*) vLLM's compiled ops import, for `install` to look up in the
    image's libtorch: a missing one is an ABI gap that no Python fix closes."""
    names = set()
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.endswith(".so"):
                so = z.extract(n, tmp)
                nm = subprocess.run(["nm", "-D", "--undefined-only", so], capture_output=True, text=True).stdout
                names |= {ln.split()[-1] for ln in nm.splitlines() if ln.split()[-1].startswith(("aoti_torch", "torch_"))}
                os.unlink(so)
    out.write_text("".join(n + "\n" for n in sorted(names)))
    return len(names)


def fetch(version: str, dl: Path, suffix: bool = True) -> None:
    """vLLM's wheel, the packages it (and tailrl) needs that the image lacks, and (suffix) arctic-inference's
    sdist with the nanobind its build pins, into DL; writes DL/carried.txt and DL/vllm_torch_symbols.txt."""
    dl.mkdir(parents=True, exist_ok=True)
    pip("download", "-q", "--no-deps", *TARGET, "-d", str(dl), f"vllm=={version}")
    wheel = next(dl.glob(f"vllm-{version}-*.whl"))
    groups = plan(wheel_requires(wheel))
    with tempfile.TemporaryDirectory() as tmp:
        pins = resolve([s for s, _ in groups["carry"]] + TAILRL_EXTRA, Path(tmp))
    pip("download", "-q", "--no-deps", *TARGET, "-d", str(dl), *pins)
    if suffix:
        pip("download", "-q", "--no-deps", *TARGET, "-d", str(dl), NANOBIND)
        pip("download", "-q", "--no-deps", "--no-build-isolation", "--no-binary=:all:", "-d", str(dl), ARCTIC)
    n = torch_symbols(wheel, dl / "vllm_torch_symbols.txt")
    names = [norm(parse_name(p.name)) for p in dl.iterdir() if p.suffix == ".whl"]
    if len(names) != len(set(names)):
        raise SystemExit(f"fetch: two versions of one package in {dl}: clear it and fetch again")
    lines = [f"# vllm {version}: {len(pins)} packages resolved for CPython 3.12 manylinux x86_64; "
             f"{n} torch C symbols in vllm_torch_symbols.txt"]
    for g in ("out", "image"):
        lines += [f"# {g}: {spec}: {why}" for spec, why in groups[g]]
    lines += [f"{p.name} {p.stat().st_size}" for p in sorted(dl.iterdir()) if p.is_file() and p.suffix in (".whl", ".gz")]
    (dl / "carried.txt").write_text("\n".join(lines) + "\n")


def parse_name(filename: str) -> str:
    return filename.split("-")[0]


def check_tags(folder: Path) -> list[str]:
    """Wheels in FOLDER that CPython 3.12 on manylinux x86_64 would not install (by their file names' tags)."""
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename

    ok = set(cpython_tags((3, 12), ["cp312", "abi3", "none"], PLATFORMS)) | set(compatible_tags((3, 12), "cp312", PLATFORMS))
    return [p.name for p in sorted(folder.glob("*.whl")) if not parse_wheel_filename(p.name)[3] & ok]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="vLLM's Requires-Dist: carried / the image has it / left out")
    p.add_argument("wheel", type=Path)
    f = sub.add_parser("fetch", help="download vLLM, what it needs, arctic-inference's sdist into DL")
    f.add_argument("version")
    f.add_argument("dl", type=Path)
    f.add_argument("--no-suffix", action="store_true", help="leave arctic-inference out")
    c = sub.add_parser("check", help="wheels in a folder that CPython 3.12 manylinux x86_64 would not take")
    c.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        for g, rows in plan(wheel_requires(args.wheel)).items():
            print(f"== {g} ({len(rows)})")
            for spec, why in rows:
                print(f"  {spec:<48} {why}")
    elif args.cmd == "fetch":
        fetch(args.version, args.dl, suffix=not args.no_suffix)
        print((args.dl / "carried.txt").read_text(), end="")
    else:
        bad = check_tags(args.folder)
        n = len(list(args.folder.glob("*.whl")))
        print(f"check: {n - len(bad)} of {n} wheels fit CPython 3.12 manylinux x86_64" + (f"; not: {bad}" if bad else ""))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
