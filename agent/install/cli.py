"""`cni-install`: the init container (once) and the watcher (`--watch`) of the CNI plugin."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Annotated

import typer

from agent.install import conflist as cl
from agent.install.installer import Installer, InstallOptions
from agent.install.runtime import InstallError

log = logging.getLogger("aether.install")

app = typer.Typer(add_completion=False, help=__doc__)


def exit_action(installer: Installer, ds_name: str, ds_namespace: str,
                kubeconfig: str | None) -> str:
    """On SIGTERM in watch mode: uninstall, unless our DaemonSet still exists (upgrade)."""
    if not ds_name:
        installer.uninstall()
        return "uninstalled"
    from agent.install.kube import DaemonSetState, daemonset_state

    state = daemonset_state(kubeconfig, ds_namespace, ds_name)
    if state in (DaemonSetState.ABSENT, DaemonSetState.DELETING):
        log.info("DaemonSet %s/%s is %s: removing aether-cni", ds_namespace, ds_name,
                 state.value)
        installer.uninstall()
        return "uninstalled"
    log.info("DaemonSet %s/%s is %s: upgrade or restart, leaving the entry so new pods wait "
             "for the next agent instead of starting uncaptured", ds_namespace, ds_name,
             state.value)
    return "kept"


@app.command()
def install(
    cni_conf_dir: Annotated[str, typer.Option(help="kubelet's CNI config dir.")] = "/etc/cni/net.d",
    cni_bin_dir: Annotated[str, typer.Option(help="Host CNI plugin dir.")] = "/opt/cni/bin",
    conflist: Annotated[str | None, typer.Option(
        "--conflist", metavar="NAME", help="Use this file instead of kubelet's choice.")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Keep repairing until SIGTERM.")] = False,
    uninstall: Annotated[bool, typer.Option("--uninstall", help="Remove entry and files.")] = False,
    agent_socket: Annotated[str, typer.Option(
        help="netconf agent_socket: the agent's CNI socket.")] = "/var/run/aether/cni.sock",
    capture_redirect_all_default: Annotated[bool, typer.Option(
        "--capture-redirect-all-default/--no-capture-redirect-all-default",
        envvar="CAPTURE_REDIRECT_ALL_DEFAULT",
        help="netconf capture_redirect_all_default (chart: captureRedirectAllDefault).")] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
    log_format: Annotated[str, typer.Option(help="auto, json or text.")] = "auto",
    python_runtime: Annotated[str, typer.Option(
        help="auto: native where the compiled shim can be built, else copy; native: the "
             "compiled shim, no Python on the host at all; copy: ship our interpreter into "
             "<bin>/aether/runtime; host: use this one.")
    ] = "auto",
    daemonset_name: Annotated[str, typer.Option(
        help="Our DaemonSet: present on exit means upgrade (keep the entry). Empty: always "
             "uninstall on exit.")] = "aether-agent",
    daemonset_namespace: Annotated[str, typer.Option(envvar="POD_NAMESPACE",
                                                     help="Its namespace.")] = "aether-system",
    kubeconfig: Annotated[str | None, typer.Option(
        help="Kubeconfig; default in-cluster config.")] = None,
    interval: Annotated[float, typer.Option(help="Watch poll interval, seconds.")] = 0.5,
    state_file: Annotated[str, typer.Option(
        help="Where repairs are recorded for `aether-agent status` (empty: nowhere).")
    ] = "/var/run/aether/cni-install.json",
) -> None:
    """Install aether-cni (chained last) into kubelet's CNI config and the host bin dir."""
    from agent.common import logs

    logs.setup(log_level, log_format)
    python_runtime = resolve_runtime(python_runtime)
    opts = InstallOptions(
        cni_conf_dir=cni_conf_dir, cni_bin_dir=cni_bin_dir, conflist=conflist,
        netconf=cl.NetconfOptions(agent_socket=agent_socket,
                                  capture_redirect_all_default=capture_redirect_all_default,
                                  log_level=log_level),
        python_runtime=python_runtime, interval=interval, state_file=state_file,
    )
    installer = Installer(opts)
    if uninstall:
        installer.uninstall()
        return
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if not watch:
            if not installer.install(stop):
                log.error("stopped before a CNI config appeared in %s", cni_conf_dir)
                raise typer.Exit(1)
            return
        installer.watch(stop)
    except (InstallError, cl.ConfigError, OSError) as e:
        log.error("cni-install failed: %s", e)
        raise typer.Exit(1) from e
    log.info("stopping after %d repairs", installer.repairs)
    exit_action(installer, daemonset_name, daemonset_namespace, kubeconfig)


def resolve_runtime(choice: str) -> str:
    """``auto`` → the native shim (~1 ms to start) where it can be built, else the Python
    shim with our copied interpreter; says which."""
    if choice != "auto":
        return choice
    from agent.cni.shim import native_binary

    if native_binary() is not None:
        log.info("installing the native aether-cni shim (--python-runtime auto)")
        return "native"
    log.warning("no C compiler to build the native aether-cni shim: installing the Python shim "
                "with a copied interpreter (--python-runtime auto → copy; ADD is slower)")
    return "copy"


def main() -> None:
    app(prog_name=os.path.basename(sys.argv[0]) if sys.argv else "cni-install")


if __name__ == "__main__":
    main()
