"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

The holder renews ``spec.renewTime`` every ``retry_period``. Others take the lease over once
they have seen the *same* lease record unchanged for ``lease_duration`` seconds of their own
clock (so clock skew between machines does not matter). Every write is a PUT carrying the
``resourceVersion`` that was read, so when two candidates race exactly one wins (the other
gets 409). A leader that cannot renew for ``renew_deadline`` steps down; on a clean shutdown
it releases the lease so a successor need not wait for it to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from modelcache.kube.client import LEASES, Kube
from modelcache.kube.objects import meta
from modelcache.runtime.clock import rfc3339

log = logging.getLogger(__name__)


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_started_leading: Callable[[], None] | None = None,
        on_stopped_leading: Callable[[], None] | None = None,
        release_on_cancel: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.release_on_cancel = release_on_cancel
        self._clock = clock
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, resourceVersion) last seen
        self._observed_at = 0.0
        self._renewed_at = float("-inf")  # our clock when we last wrote the lease as its holder
        self._leading = threading.Event()
        self._stop = threading.Event()
        self._paused = threading.Event()  # test hook: stop renewing without releasing (a hung leader)
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self._leading.is_set()

    def holds(self) -> bool:
        """Leading *and* the lease renewed within ``renew_deadline`` by our own clock: what a
        worker checks before it acts. A process that was paused (SIGSTOP, a long GC, a frozen
        VM) still believes it leads until its renew loop runs again; by then a successor may
        have taken over, and its writes must not race the successor's. The monotonic clock runs
        on while the process is stopped, so the first check after a pause says no."""
        return self._leading.is_set() and self._clock() - self._renewed_at < self.renew_deadline

    def wait_for_leadership(self, timeout: float | None = None) -> bool:
        return self._leading.wait(timeout)

    # -- one attempt ------------------------------------------------------------------------
    def _spec(self, transitions: int, acquire_time: str) -> dict[str, Any]:
        now = rfc3339(digits=6)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "acquireTime": acquire_time or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """One step of the protocol; True when we hold the lease afterwards."""
        try:
            lease = self.kube.get_or_none(LEASES, self.name, self.namespace)
            if lease is None:
                body = {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0, "")}
                started = self._clock()
                self.kube.create(LEASES, body, self.namespace)
                self._observe(body["spec"], "created")
                self._renewed_at = started
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            self._observe(spec, meta(lease).resource_version or None)
            if holder and holder != self.identity:
                duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
                if self._clock() < self._observed_at + duration:
                    return False  # someone else holds a lease that is still fresh
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder == self.identity:
                lease["spec"] = self._spec(transitions, spec.get("acquireTime") or "")
            else:
                lease["spec"] = self._spec(transitions + 1, "")
            started = self._clock()  # the lease counts from when we sent the write, not when it returned
            updated = self.kube.replace(LEASES, lease, self.namespace)
            self._observe(updated.get("spec") or {}, meta(updated).resource_version or None)
            self._renewed_at = started
            return True
        except ApiException as exc:
            # 409: another candidate wrote first; others: the API is unreachable. Either way, not now.
            log.debug("lease %s/%s: attempt failed with %s", self.namespace, self.name, exc.status)
            return False
        except Exception as exc:
            log.debug("lease %s/%s: attempt failed: %s", self.namespace, self.name, type(exc).__name__)
            return False

    def _observe(self, spec: dict[str, Any], rv: Any) -> None:
        record = (spec.get("holderIdentity"), spec.get("renewTime"), rv)
        if record[:2] != (self._observed or (None, None))[:2]:
            self._observed_at = self._clock()
        self._observed = record

    def release(self) -> bool:
        """Give the lease up now (only if we still hold it) so a successor takes over at once."""
        try:
            lease = self.kube.get_or_none(LEASES, self.name, self.namespace)
            if not lease or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return False
            spec = lease["spec"]
            spec["holderIdentity"] = None
            spec["leaseDurationSeconds"] = 1
            spec["renewTime"] = rfc3339(digits=6)
            self.kube.replace(LEASES, lease, self.namespace)
            return True
        except Exception as exc:
            log.warning("lease %s/%s: release failed: %s", self.namespace, self.name, type(exc).__name__)
            return False

    # -- the loop ---------------------------------------------------------------------------
    def start(self) -> LeaderElector:
        self._thread = threading.Thread(target=self.run, name=f"leader-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def pause_renewing(self) -> None:
        """Behave like a hung process: keep believing, stop writing (for failover tests)."""
        self._paused.set()

    def run(self) -> None:
        while not self._stop.is_set():
            if not self._acquire():
                return
            self._leading.set()
            log.info("lease %s/%s: %s is the leader", self.namespace, self.name, self.identity)
            # In its own thread (as client-go's goroutine): starting controllers waits for caches to
            # sync, and the lease must keep being renewed meanwhile.
            threading.Thread(target=self._call, args=(self.on_started_leading,), name=f"leader-{self.name}-start",
                             daemon=True).start()
            self._renew_until_lost()
            self._leading.clear()
            log.info("lease %s/%s: %s stopped leading", self.namespace, self.name, self.identity)
            self._call(self.on_stopped_leading)
        if self.release_on_cancel and not self._paused.is_set():
            self.release()

    def _acquire(self) -> bool:
        while not self._stop.is_set():
            if self.try_acquire_or_renew():
                return True
            self._stop.wait(self.retry_period)
        return False

    def _renew_until_lost(self) -> None:
        last_renew = self._clock()
        while not self._stop.wait(self.retry_period):
            if self._paused.is_set():
                self._stop.wait()
                return
            if self.try_acquire_or_renew():
                last_renew = self._clock()
            elif self._clock() - last_renew >= self.renew_deadline:
                return

    @staticmethod
    def _call(fn: Callable[[], None] | None) -> None:
        if fn is None:
            return
        try:
            fn()
        except Exception:
            log.exception("leader election callback failed")
