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

from hp.train.config.rules import Rule, check_keys, check_value, nonempty, refuse
from hp.train.config.schema import Cluster, ConfigError

_POSITIVE = Rule("int", lambda v: v >= 1, "a positive integer")
_NAME = Rule("str", nonempty, "a device profile's name, such as h100-80g")
SIZES = {"devices": _POSITIVE, "devices_per_node": _POSITIVE}
KEYS = (*SIZES, "device")
# A device spelled out (`device: {memory_gib: 96, tflops: {bf16: 800}, ...}`): the figures `hp.plan.devices`
# builds its profile from; links one way per device, in GB/s (1e9 bytes) and microseconds.
_FIGURE = Rule("float", lambda v: v > 0, "a positive number")
DEVICE_KEYS = ("name", "memory_gib", "tflops", "memory_bandwidth_gb_s", "intra_node", "inter_node")
DTYPES = ("bf16", "fp16", "fp32")
LINK_KEYS = ("bandwidth_gb_s", "latency_us")


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
    check_keys(section, KEYS, "cluster.")
    checked = {key: check_value(f"cluster.{key}", section[key], rule) for key, rule in SIZES.items() if key in section}
    device = section.get("device")
    if device is not None:
        checked["device"] = (device_figures(device) if isinstance(device, Mapping)
                             else check_value("cluster.device", device, _NAME))
    return Cluster(**checked)


def device_figures(given: Mapping) -> dict[str, Any]:
    """A device's figures checked: `memory_gib` and `tflops` (per dtype) required; its memory's bandwidth and
    its links optional.

    >>> device_figures({"memory_gib": 96, "tflops": {"bf16": 800}, "intra_node": {"bandwidth_gb_s": 400}})
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: cluster.device.intra_node = {'bandwidth_gb_s': 400}: expected a mapping \
of bandwidth_gb_s and latency_us, both positive numbers
    """
    check_keys(given, DEVICE_KEYS, "cluster.device.")
    for key in ("memory_gib", "tflops"):
        if key not in given:
            raise ConfigError(f"cluster.device has no {key}: a device spelled out needs memory_gib and tflops "
                              "(per dtype, such as {bf16: 989}), or name a profile (device: h100-80g)")
    out: dict[str, Any] = {"name": check_value("cluster.device.name", given.get("name", "custom"), _NAME),
                           "memory_gib": check_value("cluster.device.memory_gib", given["memory_gib"], _FIGURE)}
    tflops = given["tflops"]
    if not isinstance(tflops, Mapping) or not tflops:
        raise refuse("cluster.device.tflops", tflops, f"a mapping of dtype ({', '.join(DTYPES)}) to peak TFLOP/s")
    check_keys(tflops, DTYPES, "cluster.device.tflops.")
    out["tflops"] = {k: check_value(f"cluster.device.tflops.{k}", v, _FIGURE) for k, v in tflops.items()}
    if "memory_bandwidth_gb_s" in given:
        out["memory_bandwidth_gb_s"] = check_value("cluster.device.memory_bandwidth_gb_s",
                                                   given["memory_bandwidth_gb_s"], _FIGURE)
    for link in ("intra_node", "inter_node"):
        value = given.get(link)
        if value is None:
            continue
        if not isinstance(value, Mapping) or set(value) != set(LINK_KEYS):
            raise refuse(f"cluster.device.{link}", value, "a mapping of bandwidth_gb_s and latency_us, both "
                         "positive numbers")
        out[link] = {k: check_value(f"cluster.device.{link}.{k}", v, _FIGURE) for k, v in value.items()}
    return out
