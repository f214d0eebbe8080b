"""What a zoo family is: its declared parameters and its generator."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..device_groups import MAX_DEVICES

MAX_PARTITIONED_DEVICES = 1024   # XLA's partitioner compiles for devices that must exist (fake host devices)

ParamValue = int | float | str | bool


@dataclass(frozen=True)
class ZooParam:
    """One parameter of a zoo family: ``name=value`` in a spec, parsed to ``type``. ``optional``: left out of
    the canonical spelling while it has its default (a parameter added to a family after programs were named
    by their canonical specs: those names stay what they were)."""

    name: str
    type: type
    default: ParamValue
    help: str = ""
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False

    def parse(self, text: str) -> ParamValue:
        """The value written as ``text``; raises ValueError with a message for the user."""
        if self.type is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{self.name}={text} is not a boolean (use true or false)")
        if self.type is int:
            try:
                value: ParamValue = int(text, 10)
            except ValueError:
                raise ValueError(f"{self.name}={text} is not an integer") from None
        elif self.type is float:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{self.name}={text} is not a number") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{self.name}={text} is not a finite number")
        else:
            value = text
        self.validate(value)
        return value

    def validate(self, value: ParamValue) -> None:
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}={value} is not one of {', '.join(self.choices)}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name}={value} is below the minimum {_num(self.minimum)}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{self.name}={value} is above the maximum {_num(self.maximum)}")

    def format(self, value: ParamValue) -> str:
        """The canonical spelling of ``value`` in a spec."""
        if isinstance(value, bool):
            return "true" if value else "false"
        return repr(value) if isinstance(value, float) else str(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class ZooEntry:
    """A zoo family: the parameters it takes and how to generate its StableHLO.

    ``devices(params)`` is the device count of the program. ``generate(params)`` runs in a fresh process
    that has ``host_devices(params)`` fake host devices (XLA's partitioner needs the devices it partitions
    for; ``shard_map`` over an abstract mesh needs none) and returns StableHLO text (str) or MLIR bytecode
    (bytes); the same parameters must give the same program. ``check(params)`` returns a message when a
    combination of valid values is invalid.
    Bump ``version`` when the generator's output changes, so cached programs are re-exported.
    """

    name: str
    description: str
    params: tuple[ZooParam, ...]
    generate: Callable[[dict[str, Any]], str | bytes]
    devices: Callable[[dict[str, Any]], int] = field(default=lambda p: int(p.get("devices", 1)))
    host_devices: Callable[[dict[str, Any]], int] = field(
        default=lambda p: int(p.get("devices", 1)) if str(p.get("parallel", "")).endswith("-partitioned") else 1)
    check: Callable[[dict[str, Any]], str | None] | None = None
    version: int = 1

    def param(self, name: str) -> ZooParam | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    def defaults(self) -> dict[str, ParamValue]:
        return {p.name: p.default for p in self.params}


__all__ = ["MAX_DEVICES", "MAX_PARTITIONED_DEVICES", "ParamValue", "ZooEntry", "ZooParam"]
