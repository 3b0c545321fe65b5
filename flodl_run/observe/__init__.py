"""What a run tells the outside while it trains: the observer interface (`observer`) and the
timeline recorder every process appends to (`timeline`).

Layer 1: may import `config`, `contracts`, `hardware`. Reports (layer 3) implement observers.
"""
