"""ServerPool bookkeeping that needs no server: generator idle time; the
client's imports."""

import asyncio
import os
import subprocess
import sys

import pytest

from sao_jax.rollout import client as client_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def test_generator_idle_fraction_counts_time_with_nothing_in_flight(
    monkeypatch):
  clock = [100.0]
  monkeypatch.setattr(client_lib.time, 'monotonic', lambda: clock[0])

  async def scenario():
    # Channels are lazy: nothing listens on these ports and nothing is sent.
    async with client_lib.ServerPool(['127.0.0.1:9', '127.0.0.1:10'],
                                     probe_interval_s=1e9) as pool:
      clock[0] = 102.0
      first = await pool._acquire(deadline=1e9)  # busy from 102
      second = await pool._acquire(deadline=1e9)  # the other server, 102
      third = await pool._acquire(deadline=1e9)  # first again: 2 in flight
      assert {first.address, second.address} == set(pool.in_flight())
      assert third is first
      clock[0] = 104.0
      await pool._release(second)  # second idle again from 104
      await pool._release(third)  # first still has one in flight
      clock[0] = 106.0
      await pool._release(first)  # first idle from 106
      clock[0] = 110.0
      return pool.generator_idle_fraction()

  # 10 s per server: first idle 2 + 4 = 6 s, second 2 + 6 = 8 s.
  assert asyncio.run(scenario()) == pytest.approx((6 + 8) / 20)


def test_client_imports_no_jax():
  # Workers' client code runs beside the learner but needs no accelerator
  # stack: the wire format lives in `wire`, free of JAX.
  code = ('import sys; import sao_jax.rollout.client;'
          ' print("jax" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, check=True, env=dict(
                           os.environ, PYTHONPATH=_ROOT + os.pathsep
                           + os.environ.get('PYTHONPATH', '')))
  assert out.stdout.strip() == 'False', out.stderr
