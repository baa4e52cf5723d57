"""The runtime that ``hvdlite.init()`` builds, behind the horovod.torch surface at the
package's top level (basics, ops, functions, optimizer, ...). Private: the public modules
import these as ``_state``, ``_groups``, ... .

- ``state``: the one home of mutable state: the per-init() State and the process-lifetime
  ``process`` (Note [Init numbers] in basics.py).
- ``native``: imports the extension hvdlite._core once, after torch.
- ``checks``: the collectives' argument checks and the reduce-op vocabulary.
- ``groups``: an engine's process groups and shared-memory channel (start_engine).
- ``group_store``: the store the Gloo groups rendezvous through, in two requests.
- ``settings``: the build check and the job-wide settings every rank agrees on.
- ``liveness``: every rank's record, and naming a lost peer (Note [Failure census]).
- ``failure``: a rank's failure report (Note [Failure reports]).
- ``store``: the torch Store over hvdliterun's rendezvous server (SecretStore).
- ``elastic_worker``: an elastic worker's side of the conversation with its launcher.
"""
