"""Build of nanscan's native extension nanscan._C: C++/OpenMP always, CUDA when nvcc is found; and of
nanscan._torch_access, the plan check's tensor reads through torch's headers, when torch is importable (else its
source goes into the package, built at first use for the torch that runs nanscan).

The extension is optional: when it cannot be compiled (no C++ compiler), nanscan still installs and runs on its
numba and reference backends, and `nanscan info` says why the native one is missing.
Environment:
  NANSCAN_CUDA=1/0        force the CUDA part on (a failure is then an error) or off; default: on if nvcc is found
  NANSCAN_CUDA_ARCH       semicolon-separated SM list, e.g. "90" or "80;90"; default "80;90" plus PTX for the last
  NANSCAN_NATIVE_ARCH=0   do not compile the CPU kernel with -march=native (for wheels that travel); a target name
                          instead (x86-64-v3: AVX2) compiles it with -march=<that>
  NANSCAN_REQUIRE_NATIVE=1  fail the install when a C++ extension does not build
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cuda_arch_flags() -> tuple[list[str], str]:
    archs = [a.strip().replace("sm_", "") for a in os.environ.get("NANSCAN_CUDA_ARCH", "80;90").split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    return flags, ";".join(archs)


class NativeBuild(build_ext):
    """Compiles the .cu sources with nvcc into objects linked into nanscan._C, and tolerates a missing compiler."""

    def build_extensions(self):
        for ext in self.extensions:
            if ext.name == "nanscan._C":  # the CUDA kernels link into the one kernel module
                self._add_cuda(ext)
        super().build_extensions()

    def _add_cuda(self, ext):
        want = _flag("NANSCAN_CUDA")
        nvcc = _nvcc()
        if want is False or (want is None and nvcc is None):
            return
        if nvcc is None:
            raise RuntimeError("NANSCAN_CUDA=1 but nvcc was not found; set CUDA_HOME or put nvcc on PATH")
        if not any((CSRC / "cuda").glob("*.cu")):
            return
        try:
            # Ask nvcc where its libraries are: nvcc may be a wrapper script (/usr/local/bin/nvcc), so the toolkit
            # is not always two directories above it.
            dryrun = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                    capture_output=True, text=True, check=True)
        except (subprocess.CalledProcessError, OSError) as exc:
            if want:
                raise
            print(f"nanscan: CUDA part not built ({exc}); set NANSCAN_CUDA=1 to make this an error", file=sys.stderr)
            return
        flags = [flag.strip('"') for line in (dryrun.stdout + dryrun.stderr).splitlines() if "LIBRARIES=" in line
                 for flag in line.split("LIBRARIES=", 1)[1].split()]
        cuda_home = Path(nvcc).resolve().parent.parent
        lib_dirs = [f[2:] for f in flags if f.startswith("-L") and Path(f[2:]).name != "stubs"]
        lib_dirs = [d for d in dict.fromkeys([*lib_dirs, str(cuda_home / "lib64"), str(cuda_home / "lib")])
                    if (Path(d) / "libcudart_static.a").exists()]
        if not lib_dirs:
            message = f"libcudart_static.a not found next to {nvcc} (set CUDA_HOME to the CUDA toolkit)"
            if want:
                raise RuntimeError(message)
            print(f"nanscan: CUDA part not built ({message}); set NANSCAN_CUDA=1 to make this an error",
                  file=sys.stderr)
            return
        try:
            objects = self._compile_cuda(nvcc, ext)
        except (subprocess.CalledProcessError, OSError) as exc:
            if want:
                raise
            print(f"nanscan: CUDA part not built ({exc}); set NANSCAN_CUDA=1 to make this an error", file=sys.stderr)
            return
        ext.extra_objects += objects
        ext.define_macros += [("NANSCAN_WITH_CUDA", "1"), ("NANSCAN_CUDA_ARCH_LIST", f'"{_cuda_arch_flags()[1]}"')]
        ext.library_dirs += lib_dirs[:1]
        # Static cudart: the module imports on machines without a CUDA runtime installed (the driver is loaded lazily).
        ext.libraries += ["cudart_static", "rt", "pthread", "dl"]

    def _compile_cuda(self, nvcc: str, ext) -> list[str]:
        """nvcc objects for csrc/cuda/*.cu, reused from build/nanscan-cuda when sources and flags are unchanged.

        pip builds editable installs in a fresh temporary directory each time, so without this cache every
        rebuild of the C++ part would recompile the kernels for every architecture (the slow part of a build).
        """
        import hashlib

        arch_flags, _ = _cuda_arch_flags()
        # -t: nvcc compiles the architectures in parallel.
        flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-t", "0", "-Xcompiler", "-fPIC",
                 f"-I{CSRC / 'include'}", f"-I{CSRC}", *arch_flags]
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        inputs = sorted([*(CSRC / "cuda").glob("*"), *(CSRC / "include").rglob("*")])
        digest = hashlib.sha256("\0".join([version, *flags]).encode())
        for path in inputs:
            if path.is_file():
                digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes())
        out_dir = ROOT / "build" / "nanscan-cuda" / digest.hexdigest()[:16]
        objects = []
        for source in sorted((CSRC / "cuda").glob("*.cu")):
            obj = out_dir / (source.stem + ".o")
            if not obj.exists():
                out_dir.mkdir(parents=True, exist_ok=True)
                partial = obj.with_suffix(f".{os.getpid()}.tmp.o")  # renamed into place only when complete
                cmd = [nvcc, "-c", str(source), "-o", str(partial), *flags]
                print(" ".join(cmd), file=sys.stderr)
                subprocess.check_call(cmd)
                os.replace(partial, obj)
            objects.append(str(obj))
        return objects

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - compiler missing or failing: fall back to numba at run time
            if not ext.optional:
                raise
            self._failed.add(self.get_ext_fullpath(ext.name))
            print(f"nanscan: native extension not built ({exc}); nanscan will use its numba backend",
                  file=sys.stderr)

    # An extension that failed to build has no file to copy into the wheel or the source tree. (An optional
    # extension's missing file is also skipped by setuptools' copy into the source tree of an editable install.)
    def run(self):
        self._failed = set()
        super().run()
        if self.inplace or self.editable_mode:
            self._remove_stale_inplace_extensions()

    def _remove_stale_inplace_extensions(self):
        """An editable install imports the extension from the source tree: one left there by an earlier build
        would run old code instead of the numba fallback that the failure message promises."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            fullname = self.get_ext_fullname(ext.name)
            filename = self.get_ext_filename(fullname)
            if os.path.join(self.build_lib, filename) not in self._failed:
                continue
            package_dir = build_py.get_package_dir(".".join(fullname.split(".")[:-1]))
            stale = Path(package_dir, os.path.basename(filename))
            if stale.exists():
                print(f"nanscan: removing {stale}, left by an earlier build", file=sys.stderr)
                stale.unlink()

    def get_outputs(self):
        return [o for o in super().get_outputs() if o not in getattr(self, "_failed", ())]

    def get_output_mapping(self):
        failed = getattr(self, "_failed", ())
        return {k: v for k, v in super().get_output_mapping().items() if k not in failed and v not in failed}


# What nanscan._torch_access is built from at first use where torch was not importable here (pip's isolated build):
# nanscan/engine/torch_access_build.py's SOURCES, relative to csrc/ and to nanscan/_csrc in the installed package.
TORCH_ACCESS_SOURCES = ("torch/tensor_access.cpp", "include/nanscan/tensor_access.h")


class PackageBuild(build_py):
    """Also copies the source of nanscan._torch_access into the package (nanscan/_csrc), so that an installed nanscan
    can build it for the torch that runs it (NOTE: [first-use build] in nanscan/engine/torch_access_build.py). An
    editable install reads it from csrc/, beside the package."""

    def run(self):
        super().run()
        if not self.editable_mode:
            for source, target in self._torch_access_sources():
                self.mkpath(os.path.dirname(target))
                self.copy_file(source, target)

    def _torch_access_sources(self) -> list[tuple[str, str]]:
        return [(str(CSRC / name), os.path.join(self.build_lib, "nanscan", "_csrc", name))
                for name in TORCH_ACCESS_SOURCES]

    def get_outputs(self, include_bytecode=1):
        extra = [] if self.editable_mode else [target for _, target in self._torch_access_sources()]
        return super().get_outputs(include_bytecode) + extra


def _headers() -> list[str]:
    """The C++ headers, so that `setup.py build_ext` rebuilds a module whose sources did not change but a header they
    include did (setuptools compares the timestamps of sources and `depends` only)."""
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*.h"))


def _extensions():
    from pybind11.setup_helpers import Pybind11Extension

    cxx_flags = ["-O3", "-fopenmp"]
    arch = os.environ.get("NANSCAN_NATIVE_ARCH", "")
    if _flag("NANSCAN_NATIVE_ARCH") is not False and sysconfig.get_platform().endswith(("x86_64", "amd64")):
        named = arch.lower() not in ("", "1", "true", "yes", "on")
        cxx_flags.append(f"-march={arch}" if named else "-march=native")
    return [
        Pybind11Extension(
            "nanscan._C",
            sources=["csrc/bindings.cpp", "csrc/cpu/compact_cpu.cpp", "csrc/cpu/scan_cpu.cpp", "csrc/plan/plan_check.cpp"],
            include_dirs=["csrc/include", "csrc"],
            depends=_headers(),
            extra_compile_args=cxx_flags,
            extra_link_args=["-fopenmp"],
            cxx_std=17,
            # Optional: a failed build leaves nanscan installable (numba backend) unless asked to fail.
            optional=not (_flag("NANSCAN_REQUIRE_NATIVE") or _flag("NANSCAN_CUDA")),
        )
    ]


def _torch_access_extension():
    """nanscan._torch_access (csrc/torch, NOTE: [tensor access]): the plan check's tensor reads through torch's C++
    headers, for the torch that is importable at build time (make installs nanscan without build isolation, after
    torch). Where torch is not importable (pip's isolated build), the installed nanscan builds it at first use for the
    torch that runs it (NOTE: [first-use build] in nanscan/engine/torch_access_build.py)."""
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError as exc:
        print(f"nanscan: nanscan._torch_access not built here ({exc}); nanscan builds it at first use for the torch "
              "that runs it", file=sys.stderr)
        return []
    return [
        CppExtension(
            "nanscan._torch_access",
            sources=["csrc/torch/tensor_access.cpp"],
            include_dirs=["csrc/include"],
            depends=_headers(),
            define_macros=[("NANSCAN_TORCH_VERSION", f'"{torch.__version__}"'),
                           ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))],
            extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden"],
            optional=not _flag("NANSCAN_REQUIRE_NATIVE"),
        )
    ]


setup(ext_modules=_extensions() + _torch_access_extension(),
      cmdclass={"build_ext": NativeBuild, "build_py": PackageBuild})
