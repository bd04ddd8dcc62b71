from fp8flow_ao.torchtitan.assets import main

main()
