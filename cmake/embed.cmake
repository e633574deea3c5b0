# Writes a text file into a C header as a NUL-terminated char array, so that
# a file kept in its own language (the report's script) is built into the
# tool with no tool beyond CMake: cmake -DIN=file -DOUT=header -DNAME=symbol
# -P embed.cmake
file(READ "${IN}" content HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," content "${content}")
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){24})" "\\1\n" content "${content}")
get_filename_component(source "${IN}" NAME)
file(WRITE "${OUT}.tmp" "/* Generated from ${source} by cmake/embed.cmake: do not edit. */\n"
  "static const char ${NAME}[] = {\n${content}0x00};\n")
# (Rewritten only when it changed, so that what includes it is not rebuilt.)
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUT}.tmp" "${OUT}")
file(REMOVE "${OUT}.tmp")
