"""Facts about the machine a process runs on: devices (`devices`), host identity and its report
(`hostinfo`), memory budgets and probes (`membudget`, `memprobe`), and the emulated slowdown of
a rig (`slowdown`).

Layer 0: may import `contracts` only.
"""
