"""Build hook only (all metadata is in pyproject.toml): ship the top-level metal/*.metal kernel sources
inside the wheel as moepack/metal/, where moepack.runtime.metal.sources.kernel_dir() finds them when moepack
is installed rather than run from a checkout."""

from pathlib import Path
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        src = ROOT / "metal"
        if src.is_dir():
            dst = Path(self.build_lib) / "moepack" / "metal"
            dst.mkdir(parents=True, exist_ok=True)
            for f in sorted(src.glob("*.metal")) + [src / "README.md"]:
                if f.is_file():
                    shutil.copy2(f, dst / f.name)


setup(cmdclass={"build_py": BuildPyWithKernels})
