from lit_rl.cli import main

main()
