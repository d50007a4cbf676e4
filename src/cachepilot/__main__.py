from cachepilot.cli import main

main()
