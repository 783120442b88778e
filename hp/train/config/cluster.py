"""The `cluster:` section: the machines a config is planned for.

`hp plan` answers for a cluster that need not exist yet: how many devices,
how many share a node, and which device (a profile name of `hp.plan.devices`).
Written in the config, the answer travels with it; `hp plan`'s flags
(`--devices`, `--devices-per-node`, `--device`) take precedence over it.
`hp train` launches on the world its `parallel:` degrees give and reads no
setting from this section (it says so in its notes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp.train.config.rules import Rule, check_value, nonempty, refuse, unknown_key
from hp.train.config.schema import Cluster

_POSITIVE = Rule("int", lambda v: v >= 1, "a positive integer")
RULES = {"devices": _POSITIVE, "devices_per_node": _POSITIVE,
         "device": Rule("str", nonempty, "a device profile's name, such as h100-80g")}


def cluster_section(section: Any) -> Cluster | None:
    """The `cluster:` section checked, or None where the config has none.

    >>> cluster_section({"devices": 64, "device": "h100-80g"})
    Cluster(devices=64, devices_per_node=None, device='h100-80g')
    >>> cluster_section({"devices": 0})
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: cluster.devices = 0: expected a positive integer
    """
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise refuse("cluster", section, "a mapping such as {devices: 64, devices_per_node: 8, device: h100-80g}")
    for key, value in section.items():
        if key not in RULES:
            raise unknown_key(key, value, tuple(RULES), "cluster.")
    return Cluster(**{key: check_value(f"cluster.{key}", section[key], rule) for key, rule in RULES.items()
                      if key in section})

