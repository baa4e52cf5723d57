"""The environment each rank starts with: the contract with hvd.init() and with torchrun code.

hvd.init() reads exactly the HVDLITE_* names set by `rank_environment`; plain torch.distributed
code reads the torchrun names. Pure functions, no I/O.
"""
import re
from typing import Dict, Mapping

from hvdlite._job import rendezvous
from hvdlite._job.place import PLACE_VARIABLES, environment
from hvdlite._job.rendezvous import Rendezvous  # noqa: F401  (the launcher's name for it)

from .hosts import SlotInfo

# Set per rank; anything of the same name in the launcher's environment is replaced.
CONTRACT_VARS = PLACE_VARIABLES + (rendezvous.ADDR, rendezvous.PORT, rendezvous.SECRET,
                                   "MASTER_ADDR", "MASTER_PORT")

# Variables that describe the launching machine or session, not the job: never sent over ssh.
_HOST_SPECIFIC = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "XAUTHORITY", "TERM",
                  "TMUX", "TMUX_PANE", "SHELL", "USER", "LOGNAME", "HOME", "MAIL", "PS1",
                  "XDG_RUNTIME_DIR", "XDG_SESSION_ID", "DBUS_SESSION_BUS_ADDRESS", "LS_COLORS"}
_HOST_SPECIFIC_PREFIXES = ("SSH_", "BASH_FUNC_", "XDG_", "KRB5")
_VALID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def rank_environment(base: Mapping[str, str], slot: SlotInfo, rdzv: Rendezvous,
                     core: Mapping[str, str]) -> Dict[str, str]:
    """`base` (the launcher's environment plus extras) with this rank's variables on top."""
    env = dict(base)
    env.update(core)
    env.update(environment(slot, slot.hostname))
    env.update(rdzv.to_env())
    return env


def exportable(env: Mapping[str, str]) -> Dict[str, str]:
    """The part of `env` worth sending to a remote host on the ssh command line."""
    return {
        k: v for k, v in env.items()
        if _VALID_NAME.match(k) and k not in _HOST_SPECIFIC
        and not k.startswith(_HOST_SPECIFIC_PREFIXES)
    }
