"""What a child process keeps of its parent's XLA_FLAGS."""

from sao_jax import xla_flags


def test_child_keeps_every_flag_but_the_fake_device_count():
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8 '
                      '--xla_backend_optimization_level=0  --xla_dump_to=/d',
         'PATH': '/bin'}
  child = xla_flags.child_environment(env)
  assert child == {'XLA_FLAGS': '--xla_backend_optimization_level=0 '
                                '--xla_dump_to=/d', 'PATH': '/bin'}
  assert 'device_count=8' in env['XLA_FLAGS']  # the parent's is untouched


def test_child_has_no_xla_flags_when_only_the_device_count_was_set():
  child = xla_flags.child_environment(
      {'XLA_FLAGS': '--xla_force_host_platform_device_count=4'})
  assert 'XLA_FLAGS' not in child
  assert xla_flags.child_environment({}) == {}


def test_a_flag_that_only_starts_like_the_device_count_stays():
  flags = '--xla_force_host_platform_device_count_extra=1'
  assert xla_flags.without_device_count(flags) == flags
