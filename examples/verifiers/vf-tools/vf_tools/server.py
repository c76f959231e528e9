"""The ``calc`` tool server of vf-tools: a ``vf.Toolset`` run as its own program over MCP."""

import verifiers.v1 as vf


class AddToolsetConfig(vf.SharedToolsetConfig):
    pass


class AddToolset(vf.Toolset[AddToolsetConfig, vf.State]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers and return the sum."""
        return str(a + b)


if __name__ == "__main__":
    AddToolset.run()
