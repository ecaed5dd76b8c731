"""Runs a ``NodeAgent`` in a child process for the crash tests (not a test module).

    python tests/plugin/agent_runner.py '{"config": {...PluginConfig...}, "kubeconfig": PATH,
                                          "boot_id_path": PATH, "crash_after": "checkpoint-started"}'

``crash_after`` names a ``DeviceState`` effect: right after it, the process sends itself SIGKILL,
exactly what ``kill -9`` in the middle of a Prepare does. SIGTERM stops the agent cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from driver.config import PluginConfig
from driver.kube.client import load_configuration
from driver.plugin.agent import NodeAgent


def main() -> int:
    spec = json.loads(sys.argv[1])
    crash_after = spec.get("crash_after")

    def hook(effect: str, claim_uid: str) -> None:
        if effect == crash_after:
            os.kill(os.getpid(), signal.SIGKILL)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agent = NodeAgent(
        PluginConfig(**spec["config"]),
        kube_configuration=load_configuration(spec["kubeconfig"]),
        boot_id_path=spec["boot_id_path"],
        effect_hook=hook,
        publish_slices=False,
    )
    agent.start()
    stop.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
