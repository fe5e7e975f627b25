"""The summary a peer writes at exit (--summary-json)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from pydantic import BaseModel, Field

from averaging.api import OUTCOMES
from dht.files import replace_private_json


class PeerSummary(BaseModel):
    peer_id: str = ""
    run_id: str
    task: str
    global_epoch: int = 0
    local_steps: int = 0
    samples: int = 0
    train_loss: Optional[float] = None
    val_loss_first: Optional[float] = None
    """Of the state it began training with: the swarm's, for a peer that downloaded it as it joined."""
    val_loss_last: Optional[float] = None
    """Of the state it left with: validated again when it downloaded the swarm's state as it left."""
    phase_seconds: Dict[str, float] = Field(default_factory=dict)
    averaging_rounds: Dict[str, int] = Field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    largest_group: int = 0
    """The most peers in one successful averaging round."""
    averaging_sent_bytes: int = 0
    """Averaging payload sent (and received), as the peer_averaging_payload_sent_bytes counter counts it."""
    longest_step_seconds: float = 0.0
    """The longest local step, averaging and state downloads included: how long this peer ever blocked."""
    state_downloads: int = 0
    nonfinite_batches: int = 0
    """Batches skipped because their loss was NaN or Inf."""
    device: str = ""
    precision: str = "fp32"
    """What the forward and loss ran in (peer/runtime/device.py resolves --precision auto)."""
    overflow_batches: int = 0
    """fp16 batches skipped because their gradients overflowed (the loss scaler lowered its scale)."""
    resumed_from: Optional[str] = None
    data_seed: Optional[int] = None
    """The seed of this peer's data order (peer/tasks/order.py): its own unless --seed fixed it."""
    data_started_at_sample: int = 0
    """Where in that order this run began: 0, or where its checkpoint had read to."""
    last_checkpoint: Optional[str] = None
    """The newest checkpoint this peer wrote."""
    checkpoint_failures: int = 0
    """Checkpoints that could not be written (a full, read-only or deleted disk); training went on."""
    dropped_contributions: int = 0
    """Other peers' contributions this peer's reducers left out (NaN/Inf, or far out by norm or direction)."""
    excluded_peers: List[str] = Field(default_factory=list)
    """Peers this peer excluded from averaging and state sharing, in order."""
    refused_peers: List[str] = Field(default_factory=list)
    """Peers this peer stopped averaging with because the updates of their groups raised its held-out loss
    (averaging/pipeline/update_check.py), in order: no verdict on any one of them."""
    state_disagreements: int = 0
    """Epochs at which this peer found its state apart from the swarm's (averaging/swarm/digests.py)."""
    rejected_downloads: int = 0
    """Downloaded states refused before they were applied (not their donor's published state, or not the swarm's)."""
    late_contributions: int = 0
    """Rounds in which this peer's contribution came after its group's grace window and was left out."""
    stood_aside: int = 0
    """Times this peer stopped reducing parts of the average for others because it was too slow for them."""
    upload_budget_mbit: Optional[float] = None
    """--max-upload-mbit (DiLoCo); None: no budget."""
    round_factor_requested: Optional[int] = None
    """The round factor its budget last asked the swarm for (1 without a budget); None: a strategy without one."""
    round_factor: Optional[int] = None
    """The swarm's round factor at its last epoch: its outer rounds were this many target batches long."""
    credit_samples: int = 0
    """Samples this peer gave: accumulated toward epochs whose round it averaged in (peer/runtime/credit.py)."""
    pauses: int = 0
    """Times this peer paused (peer pause, --active-hours, --yield-when-busy), and for how long in all."""
    paused_seconds: float = 0.0
    exit_reason: str = "running"

    def write(self, path: Path) -> None:
        """Write atomically, so a reader never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_private_json(path, self.model_dump(), indent=2)
