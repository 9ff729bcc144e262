"""The tools that read a run after (or beside) it: replay of the message log through the
same engine and handlers, the plots, and the federated feature discrepancy (FFD) metric.

They sit above the runtime (replay drives fedbus.node's engine; FFD builds the run's
models) and below the command line (fedbus.launch).
"""
