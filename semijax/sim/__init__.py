"""A calibrated discrete-event simulator of semijax training runs on large clusters.

  hardware    device and link costs (`Hardware`), the constants file
  workload    the model and batch, and what they cost (FLOPs, bytes)
  cluster     the data x pipe x tensor grid, regions, collective costs
  traces      straggler scenarios over time (`SCENARIOS`), trace files
  stepcost    the time of one step from executed widths and speeds
  strategies  how data-parallel replicas combine (a registry)
  stage       one stage's balancing, run by the library's own decision code
  simulator   `simulate(run, trace)`: the event loop
  calibrate   the measured runs, the fit of the constants, replays and their errors
  study       every policy on clusters of 64 to 4,096 devices, tables
  overhead    the controller's own cost and the speed samples' bytes at scale
"""
