"""MetadataSource backed by the Kubernetes API.

Responses are fetched raw (``_preload_content=False``) and parsed as plain JSON dicts, so the
Kubernetes and manifest-directory sources share one conversion (``pod_from_object``) and
never depend on the client's generated model classes. Reads are retried within a bounded
time budget because they sit on the CNI ADD path: the kubelet is waiting, so a slow API must
become a clear ``SourceError`` rather than a hang.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import urllib3
from kubernetes.client.exceptions import ApiException
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from agent.kube import KubeConfigError, api_client, done
from agent.kube.rest import CoreV1
from agent.source.base import PodEvent, SourceError
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object

log = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_NAME = 253


def _retryable(exc: BaseException) -> bool:
    """Transient failures: anything but a definite 404 (which is an answer, not a failure)."""
    if isinstance(exc, ApiException):
        return bool(exc.status != 404)
    return isinstance(exc, urllib3.exceptions.HTTPError | OSError | json.JSONDecodeError)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"


class KubeSource:
    """Pod/namespace lookups and pod Events against the Kubernetes API server."""

    def __init__(
        self,
        kubeconfig: str | None = None,
        *,
        node_name: str = "",
        reporting_component: str = "aether-agent",
        retry_budget: float = 5.0,
        max_attempts: int = 5,
        request_timeout: float = 5.0,
        context: str | None = None,
    ) -> None:
        try:  # fatal at startup: no config, no source
            self._api = api_client(kubeconfig, context=context, streaming=True)
        except KubeConfigError as exc:
            raise SourceError(str(exc)) from exc
        self._cfg = self._api.configuration
        self.node_name = node_name
        self.reporting_component = reporting_component
        self.retry_budget = retry_budget
        self.max_attempts = max_attempts
        self.request_timeout = request_timeout
        self._core = CoreV1(self._api)

    @property
    def host(self) -> str:
        return str(self._cfg.host)

    def describe(self) -> str:
        return f"kubernetes API {self.host}"

    def close(self) -> None:
        """Release pooled connections (the agent process normally keeps one source for life)."""
        self._api.close()

    # ---- MetadataSource ----------------------------------------------------------------------

    def get_pod(self, namespace: str, name: str, uid: str = "") -> PodMeta | None:
        obj = self._get_object(
            f"pod {namespace}/{name}",
            lambda t: self._core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=t
            ),
        )
        return None if obj is None else pod_from_object(obj)

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        obj = self._get_object(
            f"namespace {name}",
            lambda t: self._core.read_namespace(name, _preload_content=False, _request_timeout=t),
        )
        return None if obj is None else namespace_from_object(obj)

    def record_event(self, event: PodEvent) -> None:
        """Two attempts within request_timeout: an Event is never worth delaying a pod.

        A retried POST may record the Event twice (each has its own name); that beats losing it.
        """
        body = self.event_body(event)
        deadline = time.monotonic() + self.request_timeout

        def post() -> None:
            resp: Any = self._core.create_namespaced_event(  # raw urllib3 response
                event.namespace,
                body,
                _preload_content=False,
                _request_timeout=self._timeout(deadline - time.monotonic()),
            )
            done(resp)

        try:
            self._retrying(f"event {event.reason}", post, deadline, attempts=2)
        except Exception as exc:  # best effort by contract: never raise
            log.warning(
                "could not record %s event on %s %s/%s: %s",
                event.reason,
                event.kind.lower(),
                event.namespace,
                event.pod,
                _describe_error(exc.__cause__ or exc),
            )

    def event_body(self, event: PodEvent) -> dict[str, Any]:
        """The core/v1 Event JSON for a PodEvent (public so tests and dry runs can see it)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        suffix = secrets.token_hex(8)
        name = f"{event.pod[: _MAX_NAME - len(suffix) - 1]}.{suffix}"
        involved: dict[str, Any] = {
            "apiVersion": event.api_version,
            "kind": event.kind,
            "namespace": event.namespace,
            "name": event.pod,
        }
        if event.uid:
            involved["uid"] = event.uid
        source: dict[str, Any] = {"component": self.reporting_component}
        if self.node_name:
            source["host"] = self.node_name
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": event.namespace},
            "involvedObject": involved,
            "reason": event.reason,
            "message": event.message,
            "type": event.type,
            "source": source,
            "reportingComponent": self.reporting_component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        if self.node_name:
            body["reportingInstance"] = self.node_name
        return body

    # ---- plumbing (list/watch will build on _api_get_json) -----------------------------------

    def _api_get_json(
        self, path: str, query: dict[str, str] | None = None, what: str | None = None
    ) -> dict[str, Any] | None:
        """GET any API path (e.g. ``/apis/discovery.k8s.io/v1/endpointslices``) as JSON.

        Same retry budget and 404 → None semantics as get_pod; the generic entry point for
        later list/watch code and for resources the typed client does not cover.
        """

        params: dict[str, Any] = dict(query or {})

        def fetch(timeout: Any) -> Any:
            return self._core.call("GET", path, _request_timeout=timeout, **params)

        return self._get_object(what or path, fetch)

    def _timeout(self, limit: float) -> tuple[float, float]:
        t = max(0.05, limit)
        return (t, t)

    def _get_object(self, what: str, call: Callable[[Any], Any]) -> dict[str, Any] | None:
        """Run a raw GET with retries; parse JSON; 404 → None; exhausted → SourceError."""
        deadline = time.monotonic() + self.retry_budget

        def attempt() -> dict[str, Any] | None:
            remaining = deadline - time.monotonic()
            try:
                resp = call(self._timeout(min(self.request_timeout, remaining)))
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            try:
                data = resp.data
            finally:
                resp.release_conn()
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise SourceError(f"{what}: expected a JSON object, got {type(obj).__name__}")
            return obj

        return self._retrying(what, attempt, deadline)

    def _retrying(
        self, what: str, fn: Callable[[], T], deadline: float, attempts: int | None = None
    ) -> T:
        """Exponential backoff that never sleeps past the deadline (the budget is a promise)."""
        backoff = wait_exponential(multiplier=0.1, max=1.0)

        def wait(state: RetryCallState) -> float:
            return max(0.0, min(backoff(state), deadline - time.monotonic()))

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.debug(
                "kubernetes API: %s failed (attempt %d): %s",
                what,
                state.attempt_number,
                _describe_error(exc) if exc else "?",
            )

        retrying = Retrying(
            stop=stop_after_attempt(attempts or self.max_attempts)
            | stop_after_delay(max(0.0, deadline - time.monotonic())),
            wait=wait,
            retry=retry_if_exception(_retryable),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:  # anything left after retries is the source failing
            raise SourceError(
                f"kubernetes API {self.host}: cannot read {what}: {_describe_error(exc)}"
            ) from exc
