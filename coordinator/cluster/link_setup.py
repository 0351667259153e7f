"""Link setup: how a new deployment prices its first worker-to-worker pulls, over an NCCL group
when there is one, else from one measured link."""

from __future__ import annotations

import logging

from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.routing.links import LinkType
from kvmesh.coordinator.routing.transfer_planner import TransferPlanner

log = logging.getLogger(__name__)


def join_nccl(cluster: Cluster, transfers: TransferPlanner, *, may_form: bool) -> bool:
    """Plan GPU-to-GPU pulls over the NCCL group the workers already share, else (when
    `may_form`: this coordinator started them) over one formed now; False without one."""
    try:
        if not (cluster.adopt_nccl() or (may_form and cluster.setup_nccl())):
            return False
    except Exception as exc:  # no NCCL: pulls between GPUs use the object store
        log.warning("NCCL group not available (%s); GPU-to-GPU pulls use the object store", exc)
        return False
    # Start from an NVLink-class guess (50 GB/s, 2 ms); the observed pulls correct it.
    transfers.links.set(LinkType.SAME_NODE, 5e7, 2.0)
    return True


def calibrate_links(cluster: Cluster, transfers: TransferPlanner) -> None:
    """Measure one worker-to-worker link so the first pulls are priced from reality."""
    live = cluster.live_worker_ids()
    if join_nccl(cluster, transfers, may_form=True):
        return
    if len(live) < 2 or transfers.link(live[0], live[1]) is LinkType.SAME_DEVICE:
        return  # same-GPU pulls copy in place (CUDA IPC): observed pulls price that link
    try:
        bandwidth, latency = cluster.measure_link(live[0], live[1])
        transfers.calibrate(live[0], live[1], bandwidth, latency)
        log.info("link %s -> %s: %.0f MB/s, %.2f ms", live[0], live[1], bandwidth / 1e3, latency)
    except Exception as exc:  # calibration is an optimisation: keep the defaults
        log.warning("link calibration failed: %s", exc)
