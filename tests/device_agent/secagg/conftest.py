import numpy as np
import pytest

from device_agent.secagg.messages import Params, Session


def devices(n: int) -> tuple[str, ...]:
    return tuple(f"dev-{i:02d}" for i in range(n))


def inputs_for(params: Params, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {device: rng.uniform(-params.clip, params.clip, params.length) for device in params.participants}


@pytest.fixture
def session() -> Session:
    return Session(fleet="fleet", run="run-1", round=3)
