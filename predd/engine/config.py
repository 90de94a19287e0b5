"""The engine's configuration, one frozen record of its parts' own (scheduler, quotas,
limits, memory) and the session lease, the trusted uid and the tcp keys."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from predd.engine.scheduler import SchedulerConfig
from predd.memory.policy import MemoryConfig
from predd.server.identity import AuthKeys
from predd.server.request_limits import Limits
from predd.server.quotas import QuotaConfig


@dataclass(frozen=True)
class EngineConfig:
    lease_s: float = 10.0
    scheduler: SchedulerConfig = SchedulerConfig()
    quota: QuotaConfig = QuotaConfig()
    limits: Limits = Limits()
    trusted_uid: int = field(default_factory=os.geteuid)   # predd's own: kvfsd, the operator
    auth: AuthKeys | None = None                             # tcp tokens (--auth-keys)
    memory: MemoryConfig = MemoryConfig()                     # tiers, pins, admission
    speculate: bool = True   # queue a pred_sample's next step before it is asked (predd's
                             # --speculate auto turns it off on a CPU)
