"""Pure CNI config transforms: which file kubelet uses, and adding/removing our entry.

Kept free of I/O so every shape (flannel, calico, cilium, Multus, a lone `.conf`) is tested as
plain data; the installer only reads, calls these, and writes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

PLUGIN_TYPE = "aether-cni"
CONF_EXTENSIONS = (".conf", ".conflist", ".json")
MULTUS_TYPES = ("multus", "multus-shim")

JSON = dict[str, Any]


class ConfigError(ValueError):
    """A CNI config file we cannot safely rewrite (not JSON, not an object, no plugins)."""


@dataclass(frozen=True)
class NetconfOptions:
    """The netconf keys the plugin and the agent read from our entry."""

    agent_socket: str = "/var/run/aether/cni.sock"
    capture_redirect_all_default: bool = False
    log_level: str = "info"

    def entry(self) -> JSON:
        return {
            "type": PLUGIN_TYPE,
            "agent_socket": self.agent_socket,
            "capture_redirect_all_default": self.capture_redirect_all_default,
            "log_level": self.log_level,
        }


def is_config_name(name: str) -> bool:
    """libcni's ConfFiles filter: the extension decides, hidden files included."""
    return any(name.endswith(ext) for ext in CONF_EXTENSIONS)


def candidate_files(names: list[str]) -> list[str]:
    """Config file names in the order kubelet (libcni) considers them: lexicographic."""
    return sorted(n for n in names if is_config_name(n))


def select_config(files: dict[str, str]) -> str | None:
    """The file kubelet will use: the first (lexicographic) that parses as a CNI config.

    `files` maps name → text. Like the runtime, an unparsable file is skipped, not fatal.
    """
    for name in candidate_files(list(files)):
        try:
            parse(files[name])
        except ConfigError:
            continue
        return name
    return None


def parse(text: str) -> JSON:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ConfigError("not a JSON object")
    if "plugins" in doc:
        if not isinstance(doc["plugins"], list) or not all(
            isinstance(p, dict) for p in doc["plugins"]
        ):
            raise ConfigError("`plugins` is not a list of objects")
    elif not isinstance(doc.get("type"), str):
        raise ConfigError("neither a conflist (`plugins`) nor a conf (`type`)")
    return doc


def is_conflist(doc: JSON) -> bool:
    return "plugins" in doc


def is_ours(plugin: Any) -> bool:
    return isinstance(plugin, dict) and plugin.get("type") == PLUGIN_TYPE


def to_conflist(doc: JSON) -> JSON:
    """Wrap a single-plugin `.conf` into the equivalent `.conflist` (name/version lifted)."""
    if is_conflist(doc):
        return copy.deepcopy(doc)
    plugin = copy.deepcopy(doc)
    out: JSON = {"cniVersion": plugin.get("cniVersion", "1.0.0"), "name": plugin.get("name", "")}
    plugin.pop("cniVersion", None)
    plugin.pop("name", None)
    out["plugins"] = [plugin]
    return out


def conflist_name(name: str, doc: JSON) -> str:
    """The file name the result goes to: a `.conf` (or conf-shaped `.json`) becomes `.conflist`.

    `05-x.conf` → `05-x.conflist` sorts right after the `.conf`, so the old file must go.
    """
    if is_conflist(doc):
        return name
    stem = name.rsplit(".", 1)[0]
    return f"{stem}.conflist"


def _strip(plugins: list[Any]) -> list[Any]:
    """Our entries removed, here and inside Multus delegates (so we never run twice)."""
    out = []
    for p in plugins:
        if is_ours(p):
            continue
        if isinstance(p, dict) and p.get("type") in MULTUS_TYPES and isinstance(
            p.get("delegates"), list
        ):
            p = dict(p, delegates=[_strip_delegate(d) for d in p["delegates"]])
        out.append(p)
    return out


def _strip_delegate(d: Any) -> Any:
    if isinstance(d, dict) and isinstance(d.get("plugins"), list):
        return dict(d, plugins=_strip(d["plugins"]))
    return d


def is_multus(doc: JSON) -> bool:
    plugins = doc.get("plugins") if is_conflist(doc) else [doc]
    return any(isinstance(p, dict) and p.get("type") in MULTUS_TYPES for p in plugins or [])


def insert_entry(doc: JSON, entry: JSON) -> JSON:
    """`doc` as a conflist whose last plugin is `entry`, exactly once (older entry replaced)."""
    out = to_conflist(doc)
    out["plugins"] = _strip(out["plugins"]) + [copy.deepcopy(entry)]
    return out


def remove_entry(doc: JSON) -> JSON:
    """`doc` without any of our entries (a conf stays a conf)."""
    if not is_conflist(doc):
        return copy.deepcopy(doc)
    out = copy.deepcopy(doc)
    out["plugins"] = _strip(out["plugins"])
    return out


def has_entry(doc: JSON, entry: JSON | None = None) -> bool:
    """Ours is the last plugin (and equal to `entry` when given), with no duplicate."""
    if not is_conflist(doc) or not doc["plugins"]:
        return False
    plugins = doc["plugins"]
    if not is_ours(plugins[-1]) or _strip(plugins) != plugins[:-1]:
        return False
    return entry is None or plugins[-1] == entry


def contains_entry(doc: JSON) -> bool:
    """Any entry of ours anywhere (top level or Multus delegates)."""
    plugins = doc.get("plugins") if is_conflist(doc) else [doc]
    return _strip(list(plugins or [])) != list(plugins or [])


def render(doc: JSON) -> str:
    return json.dumps(doc, indent=2) + "\n"


def primary_type(doc: JSON) -> str:
    """The first plugin's type: names the CNI we chain after (for logs and fight hints)."""
    plugins = doc.get("plugins") if is_conflist(doc) else [doc]
    for p in plugins or []:
        if isinstance(p, dict) and not is_ours(p):
            return str(p.get("type", ""))
    return ""


#: What makes a primary CNI rewrite its config without our entry, by plugin type.
FIGHT_HINTS = {
    "cilium-cni": "Cilium removes foreign CNI configs: set Helm `cni.exclusive=false`",
    "calico": "Calico's install-cni rewrites its conflist when calico-node restarts; "
    "check calico-node is not crash-looping",
    "flannel": "flannel's install-cni init container rewrites its conflist on every start",
    "multus": "Multus regenerates its config from the primary CNI's; use a static Multus "
    "config (no auto-generation)",
    "multus-shim": "Multus regenerates its config from the primary CNI's; use a static "
    "Multus config (no auto-generation)",
}


def fight_hint(primary: str) -> str:
    return FIGHT_HINTS.get(primary, f"check whether `{primary or 'the primary CNI'}` "
                           "regenerates its CNI config (an 'exclusive' mode)")
