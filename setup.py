"""Metadata lives in pyproject.toml. This file only adds the CPU guard's ``.pth``
file to the top of the wheel, editable wheels included (setuptools has no declarative
way to install a file into site-packages itself); see ``src/_uniprefill_cpu_guard.py``."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "uniprefill-cpu-guard.pth"
SRC = Path(__file__).resolve().parent / "src" / PTH


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            # Editable wheels take their top-level files from the install directory.
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        self.copy_file(str(SRC), str(target / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), str(Path(self.build_lib) / PTH): str(SRC)}


setup(cmdclass={"build_py": BuildPyWithPth})
