"""Which request runs when: O3's priority tiers with deadlines for vLLM.

`--scheduler-cls vllm_o3.scheduler.O3Scheduler` plugs the policy into vLLM;
`--middleware vllm_o3.scheduler.http.O3TierMiddleware` adds the HTTP side
(request fields from headers, HTTP 400/503 answers).
"""

from vllm_o3.scheduler.scheduler import O3AsyncScheduler, O3Scheduler

__all__ = ["O3AsyncScheduler", "O3Scheduler"]
