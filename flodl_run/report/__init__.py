"""What people read about a run: terminal lines and progress, run directories, records, the
MLflow tracker, the dashboard and its charts, the live dashboard's server, sweeps and compare.

Layer 3: may import layers 0 to 2.
"""
