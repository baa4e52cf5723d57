"""The contract between whoever starts a rank and the rank itself. Torch-free: hvdliterun, the
elastic driver, hvdlite.ray and the tests import it without loading torch.

- ``place``: a rank's place in a job (one type, ``Place``), the one rule that computes it
  (Note [Cross ranks]) and the environment that carries it to the rank.
- ``launchers``: the other direction, what a rank reads from the environment its launcher
  (hvdliterun, torchrun, mpirun, SLURM) gave it.
- ``rendezvous``: hvdliterun's store as a rank reaches it, and the one place that builds a
  client for it from the environment.
- ``keys``: every key a launcher and a rank share in that store.
- ``wire``: the store's wire protocol and its client (Note [Rendezvous wire protocol]).
- ``server``: the store itself, RendezvousServer, which hvdliterun and hvdlite.ray host.
- ``netif``: this machine's interface addresses (the launcher's network discovery and a
  rank's own records both need them).
"""
