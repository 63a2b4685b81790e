"""Help answers at once (NOTE: [fast help] in nanscan/cli/main.py): `import nanscan`, `nanscan --help` and every
subcommand's help do not import torch, and the packages' public names still load, lazily."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import nanscan
from nanscan.cli.main import SUBCOMMANDS, command_summary, main

ROOT = Path(__file__).resolve().parent.parent


def modules_after(code: str) -> set[str]:
    """The modules loaded by `code` in a fresh interpreter that imports nanscan from this tree."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, env=env, check=True, timeout=120).stdout
    return set(out.splitlines()[-1].split())  # the last line: what `code` printed (a help text) comes before it


def help_modules(*args: str) -> set[str]:
    return modules_after("import sys\nfrom nanscan.cli.main import main\nsys.argv = ['nanscan', *%r]\n"
                         "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code" % (list(args),))


def test_import_nanscan_does_not_import_torch():
    loaded = modules_after("import nanscan")
    assert "nanscan" in loaded and "torch" not in loaded


# The group's help and every subcommand's: a new subcommand must answer its --help without torch too.
@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in sorted(SUBCOMMANDS))], ids=" ".join)
def test_help_does_not_import_torch(args):
    loaded = help_modules(*args)
    assert "click" in loaded and "torch" not in loaded, f"nanscan {' '.join(args)} imported torch"


def test_group_help_shows_every_subcommand_with_its_own_summary():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name, target in SUBCOMMANDS.items():
        command = main.get_command(None, name)
        assert command_summary(target) == command.get_short_help_str(), name
        assert name in result.output


def test_every_public_name_loads_lazily():
    for name in nanscan.__all__:
        assert getattr(nanscan, name) is not None
    assert set(nanscan.__all__) <= set(dir(nanscan))
    from nanscan.runtime.monitor import Monitor

    assert nanscan.Monitor is Monitor
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        nanscan.nope  # noqa: B018


@pytest.mark.parametrize("package", ["nanscan.bundle", "nanscan.replay"])
def test_the_packages_names_load_lazily(package):
    """nanscan.bundle and nanscan.replay load their names on first use too; importing either loads no torch."""
    assert "torch" not in modules_after(f"import {package}")
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


def test_functions_named_like_their_modules_stay_functions():
    """nanscan.scan is a function even after its submodule is imported; so is nanscan.headroom once its module,
    nanscan.engine.headroom, is; nanscan.replay.localize is the function beside the runtime's localize module."""
    loaded = modules_after("import nanscan.scan, nanscan.engine.headroom, nanscan\n"
                           "assert callable(nanscan.scan) and callable(nanscan.headroom), "
                           "(nanscan.scan, nanscan.headroom)\n"
                           "from nanscan.scan import scan\nassert nanscan.scan is scan")
    assert "nanscan.scan" in loaded
    loaded = modules_after("import nanscan.runtime.localize, nanscan.replay\n"
                           "from nanscan.replay import localize\n"
                           "from nanscan.replay.reproduce import localize as function\n"
                           "assert localize is function and nanscan.replay.localize is function, localize")
    assert "nanscan.runtime.localize" in loaded
