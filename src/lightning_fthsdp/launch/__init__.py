"""The local launcher (``fthsdp launch``): lighthouse, one supervised launch per replica group, failure injection,
live view and report; and ``fthsdp fit``, the LightningCLI process each group runs."""
