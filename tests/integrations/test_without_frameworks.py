"""swap_pass and ``swap_pass.integrations`` import without the frameworks; the torchtitan
integration, imported without torchtitan, says what to install; the TRL and torchtune ones import
without their tools (they need them only for a step handed back). Runs in a fresh interpreter in
which ``import torchtitan``, ``import trl`` and ``import torchtune`` fail, with or without them
installed."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
for name in ("torchtitan", "trl", "torchtune"):
    sys.modules[name] = None  # import NAME raises ImportError
import swap_pass, swap_pass.integrations, swap_pass.integrations.megatron
import swap_pass.integrations.trl, swap_pass.integrations.torchtune
print("loaded:", sorted(m for m in sys.modules
                        if m.startswith(("torchtitan.", "megatron", "trl.", "torchtune."))))
try:
    import swap_pass.integrations.torchtitan
except ImportError as err:
    print("error:", err)
"""


def test_swap_pass_imports_without_torchtitan_and_the_integration_names_the_extra():
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "loaded: []" in out, out
    assert ("error: swap_pass.integrations.torchtitan needs torchtitan 0.3.0 "
            "(pip install 'swap-pass[torchtitan]')") in out, out
