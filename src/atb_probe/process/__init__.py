"""The parts of the probe that deal with its process, each with one job.

`configwatch` reads the config file when it changes; `statusfile` keeps the status file of
SPEC §4; `hooks` closes every open probe at exit and on SIGTERM and starts them afresh in a
forked child; `identity` says which process this is (`LOCAL_RANK`, start time); `threadname`
shows the probe's threads under names of their own (`top -H`, `ps`); `stacks` looks at every
thread's stack without the hang older Pythons risk there. `probe.Probe` puts them together.
None of them imports torch.
"""
