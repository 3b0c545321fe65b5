"""What the processes of a run agree on: the control plane's messages and their codec (`wire`)
and the cap on its connections not yet past the handshake (`admission`),
the recipe contract (`recipe`), the checkpoint bundle format (`checkpoint`), the run summary
(`summary`), user scalars (`scalars`), the run's aligned clock (`clock`), the scheduler's
stop signal (`signals`) and the rank's environment as every launcher writes it (`rankenv`).

Layer 0: imports nothing of flodl_run. Everything above may import it; the coordinator and the
ranks share nothing else but these contracts and the layers below them.
"""
