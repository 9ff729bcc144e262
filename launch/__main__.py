from fedbus.launch.cli import console_main

console_main()
