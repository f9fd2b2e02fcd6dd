"""When the ranks stop: signal flags and the ranks' agreement (`preemption`), one stop decision per step
(`stopping`), hangs ended with evidence (`watchdog`; who is hung and the `hang` event: `hang_evidence`), and a
bounded, fast exit (`process_exit`). Imports `mgpu.state` and below.
"""
