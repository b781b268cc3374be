"""goodput.Timeline: a run's wall time split into training steps and the stages around them (fake clock)."""
import pytest

from transformer_jax.training import goodput


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_training_steps_are_the_loop_time_no_stage_took(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(goodput.time, 'perf_counter', clock)
  timeline = goodput.Timeline()
  with timeline.stage('setup'):
    clock.now += 5.0
  with timeline.loop():
    clock.now += 6.0  # Steps.
    with timeline.stage('checkpoint'):
      clock.now += 2.0
    timeline.add('compile', 1.5)  # Measured inside a step's call: 1.5 of the next 4 s.
    clock.now += 4.0
    with timeline.stage('evaluation'):
      clock.now += 3.0
  clock.now += 1.0  # Outside any stage.
  summary = timeline.summary()
  assert summary['wall_seconds'] == 21.0
  assert summary['train_steps_seconds'] == 6.0 + 4.0 - 1.5
  assert (summary['setup_seconds'], summary['checkpoint_seconds'], summary['evaluation_seconds'],
          summary['compile_seconds'], summary['input_seconds']) == (5.0, 2.0, 3.0, 1.5, 0.0)
  assert summary['goodput'] == pytest.approx(8.5 / 21.0)
  assert timeline.line().startswith('Wall time 21 s, goodput 40.5% (training steps): train steps 8 s (40.5%), '
                                    'compile 2 s (7.1%), evaluation 3 s (14.3%)')
  assert 'input' not in timeline.line()  # Stages that took no time are left out.


def test_unknown_stage_is_an_error():
  timeline = goodput.Timeline()
  with pytest.raises(KeyError, match="unknown stage 'train_steps'"):
    timeline.add('train_steps', 1.0)  # Training steps are what the loop's stages leave.
  with pytest.raises(KeyError, match="unknown stage 'eval'"):
    with timeline.stage('eval'):
      pass
