"""The old module names of the plugin contracts still import (a third party's code keeps working), warn,
and are the very same modules."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("old,new,name", [("kvtier.backend", "kvtier.backend_api", "StorageBackend"),
                                          ("kvtier.blockformat", "kvtier.format.blockformat", "Segments"),
                                          ("kvtier.policy", "kvtier.policy_api", "WritePolicy")])
def test_old_module_name_is_the_new_module_and_warns(old, new, name):
    code = (f"import warnings\nwith warnings.catch_warnings(record=True) as w:\n"
            f"    warnings.simplefilter('always')\n    import {old} as o\n"
            f"import {new} as n\nassert o is n and o.{name} is n.{name}\n"
            f"assert any(issubclass(x.category, DeprecationWarning) and '{new}' in str(x.message) for x in w)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {old}"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "DeprecationWarning" in r.stderr


def test_nothing_in_kvtier_imports_the_old_names():
    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                        "import kvtier.stack, kvtier.tiering.manager, kvtier.backends.local_disk, kvtier.backends.s3, "
                        "kvtier.backends.redis, kvtier.tools.bench.peers, kvtier.simulate, "
                        "kvtier.policies.write, kvtier.testing.conformance, kvtier.tools.cli"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
