"""The command line's commands: `build` (ahead-of-time builds for GPU targets), `tune` (launch configurations), `demo`
(the main job), and their progress lines."""
